"""Knowledge injection: a new fact written into the table rows of one token the model already has. The token's row in
every STEM table is trained on the fact's sentences with the language-model loss while every other weight stays
frozen, so only those rows change. The paper describes injection; the authors' reference code has none, so this is
written from the description.

`inject_fact` persists the rows (`save_pretrained` then saves them) and returns an `Injection` whose `undo` puts the
rows and the model's save id back exactly; `injected` does both around a `with` block.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from .checkpoint_stem import unsaved_id
from .modeling_stem import unwrapped_tables


@dataclass
class Injection:
    """One injected fact: the token whose rows were trained, the loss on the fact's texts before each step and after
    the last, and what `undo` puts back: the token's rows as they were, in the tables' dtype, and the save id."""

    model: nn.Module
    token: int
    losses: list[float]
    saved_rows: dict[str, torch.Tensor] = field(repr=False)
    save_id: str | None = None
    undone: bool = False

    @torch.no_grad()
    def undo(self) -> None:
        """Puts the token's rows and the model's save id back exactly as they were before the injection."""
        if self.undone:
            raise RuntimeError(f"inject_fact: the injection into token {self.token} is already undone")
        for key, row in self.saved_rows.items():
            self.model.base_model.stem_tables[key].weight[self.token] = row
        self.model.stem_save_id = self.save_id
        self.undone = True


class _TrainableRows:
    """The row source while injecting: the tables' rows, with `token`'s positions served from the trained rows."""

    def __init__(self, tables: nn.ModuleDict, token: int, rows: nn.ParameterDict):
        self.tables, self.token, self.rows = tables, token, rows

    def __call__(self, stem_input_ids: torch.LongTensor) -> "_TrainableRows":
        self.base, self.where = self.tables(stem_input_ids), (stem_input_ids == self.token).unsqueeze(-1)
        return self

    def __getitem__(self, layer_idx: int) -> torch.Tensor:
        rows = self.base[layer_idx]
        trained = self.rows[str(layer_idx)].to(rows.device)
        return torch.where(self.where.to(rows.device), trained, rows.float())


def _check_injection(model: nn.Module, texts: Sequence[str], token: int) -> None:
    """Raises on what would make the injection fail or train nothing, before any work."""
    unwrapped_tables(model, "inject_fact")
    if not getattr(model.config, "stem_layers", None):
        raise ValueError("inject_fact: this model has no STEM layers, so no table rows to write a fact into")
    vocab = model.config.vocab_size
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
        raise ValueError(f"inject_fact: token {token!r} is not a token id in the vocabulary [0, {vocab})")
    if isinstance(texts, str) or not texts:
        raise ValueError("inject_fact: texts must be a non-empty list of sentences that state the fact")
    base = model.base_model
    if base.row_source is not None or base.stem_tables.freed:
        raise ValueError(
            "inject_fact: the rows are served by a row source (an editor or an offload engine); leave it or detach "
            "the engine first, so that the trained rows are the ones the model reads"
        )


def _fact_batch(tokenizer, texts: Sequence[str], token: int) -> dict[str, torch.Tensor]:
    """The texts as one right-padded batch with labels (padding ignored); raises naming a text without `token`."""
    ids = [tokenizer(text)["input_ids"] for text in texts]
    for text, row in zip(texts, ids, strict=True):
        if token not in row:
            raise ValueError(
                f"inject_fact: the text {text!r} never contains token {token}; its loss cannot reach that token's rows"
            )
    length = max(map(len, ids))
    input_ids = torch.tensor([row + [0] * (length - len(row)) for row in ids])
    mask = torch.tensor([[1] * len(row) + [0] * (length - len(row)) for row in ids])
    return {"input_ids": input_ids, "attention_mask": mask, "labels": input_ids.masked_fill(mask == 0, -100)}


def inject_fact(
    model: nn.Module, tokenizer, texts: Sequence[str], token: int, steps: int = 100, lr: float = 3e-3
) -> Injection:
    """Writes the fact that `texts` state into the rows of `token` (an id the texts contain) in every STEM table: those
    rows are trained with Adam, in float32, on the texts' language-model loss for `steps` steps, every other weight
    frozen, then written into the tables (in their dtype). The model's training mode and `requires_grad` flags are as
    they were after. Returns the `Injection`, whose `undo` restores the rows; until then the rows stay written."""
    _check_injection(model, texts, token)
    if steps < 1 or not lr > 0:
        raise ValueError(f"inject_fact: steps must be at least 1 and lr positive, got steps={steps}, lr={lr}")
    base = model.base_model
    device = model.get_input_embeddings().weight.device
    batch = {k: v.to(device) for k, v in _fact_batch(tokenizer, texts, token).items()}
    tables = base.stem_tables
    saved = {key: table.weight.detach()[token].clone() for key, table in tables.items()}
    # copy=True: a float32 row on the same device would otherwise be `saved` itself, trained in place
    rows = nn.ParameterDict({key: nn.Parameter(row.to(device, torch.float32, copy=True)) for key, row in saved.items()})
    optimizer = torch.optim.Adam(rows.parameters(), lr=lr)
    flags = {p: p.requires_grad for p in model.parameters()}
    training = model.training
    losses = []
    model.eval()  # no dropout: the rows are fitted to the model as it is used
    for p in flags:
        p.requires_grad_(False)
    previous = base.set_row_source(_TrainableRows(tables, token, rows))
    try:
        with torch.enable_grad():
            for _ in range(steps):
                loss = model(**batch, use_cache=False).loss
                losses.append(loss.item())
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    finally:
        base.set_row_source(previous)
        for p, flag in flags.items():
            p.requires_grad_(flag)
        model.train(training)
    save_id = getattr(model, "stem_save_id", None)
    with torch.no_grad():
        for key, table in tables.items():
            table.weight[token] = rows[key].detach().to(table.weight.device, table.weight.dtype)
    model.stem_save_id = unsaved_id()  # the tables no longer hold the loaded or saved checkpoint's rows
    with torch.no_grad():  # the loss of the rows as written (in the tables' dtype), not of the float32 copies
        was_training = model.training
        model.eval()
        losses.append(model(**batch, use_cache=False).loss.item())
        model.train(was_training)
    return Injection(model, token, losses, saved, save_id)


@contextmanager
def injected(model: nn.Module, tokenizer, texts: Sequence[str], token: int, **kwargs) -> Iterator[Injection]:
    """`inject_fact` for the duration of a `with` block, then the rows and the save id exactly as they were."""
    injection = inject_fact(model, tokenizer, texts, token, **kwargs)
    try:
        yield injection
    finally:
        injection.undo()


__all__ = ["Injection", "inject_fact", "injected"]
