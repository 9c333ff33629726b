"""Knowledge editing by table rows: wherever the source's tokens occur in the input, the STEM lookups use the target's
rows while the text stays as it is. No weight changes and no extra compute, unless the edit is persisted.

Length mismatches between source (n tokens) and target (m tokens); `clone` and `filler` are the paper's names:
- `clone`: the target's tokens in order, repeated cyclically when m < n, cut to its first n when m > n (`pad` is its
  old name);
- `filler`: the target's tokens in order, then a filler token (`StemEdit.filler`: the tokenizer's pad, else eos, else
  bos) for the source positions past m; cut to its first n when m > n;
- `subset`: n target tokens chosen evenly across the target (its first and last kept when n >= 2);
- `mean`: every source position gets the mean of the target's rows (a row override, not an id swap).

Apply per call (`stem_input_ids` from `edited_ids`), as a reversible context manager (`StemEditor`, the model's row
source while active), or persisted into the tables (`persist_edit`, then `save_pretrained`; `persisted` for a block).
A persisted edit also reaches the rows an attached offload engine serves from its own copy of the tables.
"""

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from .checkpoint_stem import FREED_TABLES, unsaved_id
from .modeling_stem import StemLookup, unwrapped_tables

STRATEGIES = ("clone", "filler", "subset", "mean")
RENAMED_STRATEGIES = {"pad": "clone"}  # old name: current name


@runtime_checkable
class StemTableCopy(Protocol):
    """A row source that serves its own copy of the tables (`offload.StemOffloadEngine`): a persisted edit must be
    written into it too, or it keeps serving the rows from before the edit."""

    def check_writable(self) -> None:
        """Raises, naming why and what to do, where `write_rows` cannot change what it serves."""

    def read_rows(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """STEM layer `layer`'s rows of `ids` as served."""

    def write_rows(self, layer: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Serves `rows` for `ids` in STEM layer `layer` from now on."""

    def kept_rows(self, ids: torch.Tensor) -> AbstractContextManager:
        """Puts the rows of `ids` back exactly as they were on leaving the block."""


def table_copies(model: nn.Module) -> list[StemTableCopy]:
    """The table copies that serve `model`'s rows: its row source, and the sources under editors wrapping it."""
    copies, source = [], model.base_model.row_source
    while source is not None:
        if isinstance(source, StemTableCopy):
            copies.append(source)
        source = getattr(source, "wrapped_source", None)  # a wrapper (StemEditor) declares what it reads from
    return copies


def current_strategy(strategy: str, stacklevel: int = 2) -> str:
    """`strategy` under its current name: an old one (`RENAMED_STRATEGIES`) warns, pointing `stacklevel` frames up."""
    if strategy not in RENAMED_STRATEGIES:
        return strategy
    new = RENAMED_STRATEGIES[strategy]
    warnings.warn(
        f"strategy {strategy!r} is now called {new!r} (the paper's name for repeating the target's tokens); the "
        "paper's padding with a filler token is 'filler'",
        FutureWarning,
        stacklevel=stacklevel + 1,
    )
    return new


def filler_id(tokenizer) -> int:
    """The token the `filler` strategy fills with: the tokenizer's pad token, else its eos, else its bos."""
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        if getattr(tokenizer, name, None) is not None:
            return getattr(tokenizer, name)
    raise ValueError("edit: strategy 'filler' needs a filler token, and this tokenizer has no pad, eos or bos token")


@dataclass(frozen=True)
class StemEdit:
    """Token ids of one edit: `source` is looked for in the input, `target` supplies the rows; `filler` is the token
    the `filler` strategy gives source positions past the target's length."""

    source: tuple[int, ...]
    target: tuple[int, ...]
    strategy: str = "clone"
    filler: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "strategy", current_strategy(self.strategy, stacklevel=3))
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy: {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if not self.source or not self.target:
            raise ValueError(f"edit: the {'source' if not self.source else 'target'} holds no tokens")
        if self.strategy == "filler" and self.filler is None:
            raise ValueError(
                "edit: strategy 'filler' needs the filler token's id (StemEdit(..., filler=ID); StemEdit.from_text "
                "takes the tokenizer's pad, eos or bos token)"
            )

    @classmethod
    def from_text(cls, tokenizer, source: str, target: str, strategy: str = "clone") -> "StemEdit":
        """Tokenizes both without special tokens. A leading space is part of a word's token in most BPE vocabularies:
        pass " Paris", as it appears mid-sentence, not "Paris". The `filler` strategy fills with `filler_id`."""
        strategy = current_strategy(strategy, stacklevel=2)
        for name, text in (("source", source), ("target", target)):
            if not text.strip():
                raise ValueError(f"edit: the {name} string {text!r} is empty")
        encode = lambda text: tuple(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
        filler = filler_id(tokenizer) if strategy == "filler" else None
        edit = cls(encode(source), encode(target), strategy, filler)
        unk = getattr(tokenizer, "unk_token_id", None)
        for name, text, ids in (("source", source, edit.source), ("target", target, edit.target)):
            if unk is not None and unk in ids:
                raise ValueError(
                    f"edit: the {name} {text!r} holds a word the tokenizer maps to its unknown token "
                    f"{tokenizer.unk_token!r} (id {unk}): that row stands for every unknown word, not this one"
                )
        return edit

    def mapped_target(self) -> tuple[int, ...]:
        """The target token each source position looks up (`clone`, `filler` and `subset`)."""
        n, m = len(self.source), len(self.target)
        if self.strategy == "clone":
            return tuple(self.target[i % m] for i in range(n))
        if self.strategy == "filler":
            return tuple(self.target[i] if i < m else self.filler for i in range(n))
        if self.strategy == "subset":
            if n == 1:
                return (self.target[0],)
            return tuple(self.target[round(i * (m - 1) / (n - 1))] for i in range(n))
        raise ValueError("mapped_target: the mean strategy maps rows, not tokens")


def find_occurrences(ids: torch.Tensor, pattern: Sequence[int]) -> list[tuple[int, int]]:
    """`(row, start)` of every occurrence of `pattern` in the 2-D `ids`, overlapping ones included."""
    n = len(pattern)
    if ids.shape[1] < n:
        return []
    windows = ids.unfold(1, n, 1)  # [batch, positions, n]
    hits = (windows == torch.tensor(pattern, device=ids.device)).all(dim=-1).nonzero().tolist()
    return [(row, start) for row, start in hits]


def edited_ids(input_ids: torch.Tensor, edits: Sequence[StemEdit], require: bool = True) -> torch.Tensor:
    """`stem_input_ids` for `clone`, `filler` and `subset` edits: `input_ids` with each source occurrence's lookups
    pointed at the target's tokens. Raises if an edit's source never occurs (unless `require=False`)."""
    found = [find_occurrences(input_ids, edit.source) for edit in edits]
    if require:
        _require_occurrences(edits, found)
    return _point_ids(input_ids, edits, found)


def _require_occurrences(edits: Sequence[StemEdit], found: list[list[tuple[int, int]]]) -> None:
    missing = [edit for edit, hits in zip(edits, found, strict=True) if not hits]
    if missing:
        raise ValueError(f"edit: the source tokens {list(missing[0].source)} do not occur in the input")


def _point_ids(input_ids: torch.Tensor, edits: Sequence[StemEdit], found: list) -> torch.Tensor:
    """`input_ids` with the lookups of each id-mapping edit's occurrences (`found`) pointed at its target."""
    out = input_ids.clone()
    for edit, hits in zip(edits, found, strict=True):
        if edit.strategy == "mean":
            continue
        mapped = torch.tensor(edit.mapped_target(), device=input_ids.device)
        for row, start in hits:
            out[row, start : start + len(edit.source)] = mapped
    return out


def check_edits(model: nn.Module, edits: Sequence[StemEdit]) -> None:
    """Raises unless `model` has STEM layers and every id of `edits` is in its vocabulary."""
    if not model.config.stem_layers:
        raise ValueError("edit: this model has no STEM layers, so no table rows to edit")
    vocab = model.config.vocab_size
    for edit in edits:
        filler = (edit.filler,) if edit.strategy == "filler" else ()
        bad = [i for i in (*edit.source, *edit.target, *filler) if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"edit: token id {bad[0]} is outside the vocabulary [0, {vocab})")


class _EditedRows:
    """The rows a STEM layer sees under an edit: those of the edited ids, with `mean` positions overridden. Without
    `mean` overrides, `lookup` hands on what the wrapped source's does, so the layer may gather the edited ids' rows
    inside its own kernel as it does unedited ones."""

    def __init__(self, base, tables: nn.ModuleDict, overrides: list[tuple[torch.Tensor, torch.Tensor, tuple]]):
        self.base, self.tables, self.overrides = base, tables, overrides

    def lookup(self, layer_idx: int) -> torch.Tensor | StemLookup:
        """The wrapped source's `lookup` without `mean` overrides in this forward, else the rows gathered."""
        if self.overrides or not callable(getattr(type(self.base), "lookup", None)):
            return self[layer_idx]
        return self.base.lookup(layer_idx)

    def __getitem__(self, layer_idx: int) -> torch.Tensor:
        rows = self.base[layer_idx]
        if not self.overrides:
            return rows
        rows = rows.clone()
        weight = self.tables[str(layer_idx)].weight
        for batch_rows, positions, target in self.overrides:
            mean = weight[list(target)].float().mean(dim=0).to(device=rows.device, dtype=rows.dtype)
            rows[batch_rows, positions] = mean
        return rows


class StemEditor:
    """Applies edits to every forward while active (`with StemEditor(model, edits): model.generate(...)`), then leaves
    the model exactly as it was. Occurrences are found within each forward's ids: during `generate`, a source in the
    prompt is edited; a multi-token source that appears only across decode steps, or across prefill chunks
    (`prefill_chunk_size`), is not. `require=True` checks that the first forward holds every source: pass
    `require=False` with chunked prefill. Entered while an offload engine is attached, it edits the ids the engine
    serves; `mean` edits also read the model's tables, so they refuse tables the engine freed."""

    def __init__(self, model: nn.Module, edits: Sequence[StemEdit], require: bool = True):
        check_edits(model, edits)
        self.model, self.edits, self.require = model, list(edits), require
        self.tables = model.base_model.stem_tables
        self._source = None  # the row source the editor wraps while active
        self._active = False
        self._calls = 0

    def __call__(self, stem_input_ids: torch.LongTensor) -> _EditedRows:
        """The row source while active: finds each source's occurrences once per forward, points the id edits at their
        targets, and overrides the rows at the occurrences of `mean` edits."""
        self._calls += 1
        found = [find_occurrences(stem_input_ids, edit.source) for edit in self.edits]
        if self.require and self._calls == 1:  # the first forward (the prompt) must hold every source
            _require_occurrences(self.edits, found)
        rows = (self.tables if self._source is None else self._source)(_point_ids(stem_input_ids, self.edits, found))
        overrides = []
        for edit, hits in zip(self.edits, found, strict=True):
            if edit.strategy == "mean" and hits:
                batch_rows = torch.tensor([r for r, _ in hits for _ in edit.source])
                positions = torch.tensor([s + k for _, s in hits for k in range(len(edit.source))])
                overrides.append((batch_rows, positions, edit.target))
        return _EditedRows(rows, self.tables, overrides)

    @property
    def wrapped_source(self):
        """The row source this editor reads from while active (None: the model's tables)."""
        return self._source

    def __enter__(self) -> "StemEditor":
        if self._active:
            raise RuntimeError("StemEditor: already active; enter an editor once at a time")
        if any(e.strategy == "mean" for e in self.edits) and self.model.base_model.stem_tables.freed:
            raise ValueError("StemEditor: mean edits read the tables, which an offload engine freed (free_tables=True)")
        self._calls = 0
        self._source = self.model.base_model.set_row_source(self)
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        base = self.model.base_model
        if base.row_source is not self:
            raise RuntimeError(
                f"StemEditor: {base.row_source!r}, set inside this editor, is still active; leave it first"
            )
        base.set_row_source(self._source)
        self._source, self._active = None, False


@torch.no_grad()
def persist_edit(model: nn.Module, edit: StemEdit) -> None:
    """Writes the edit into the tables: each source token's row becomes its mapped target's row (`clone`, `filler`,
    `subset`) or the mean of the target's rows (`mean`), in every STEM layer, for every context the token appears in.
    Save with `save_pretrained`; a table memory-mapped from a checkpoint is copied on write, never its file. An
    attached offload engine serves the edited rows too (built in memory: one on a mapped store file refuses, before
    anything changes); tables it freed are edited in its copy, and come back edited when it detaches."""
    unwrapped_tables(model, "persist_edit")  # through PEFT's wrappers a write would go to a merged copy, lost
    check_edits(model, [edit])
    if edit.strategy != "mean":  # mean gives every source token the same row: repeats agree
        wanted: dict[int, int] = {}
        for source, target in zip(edit.source, edit.mapped_target(), strict=True):
            if wanted.setdefault(source, target) != target:
                raise ValueError(
                    f"persist_edit: source token {source} occurs twice in {list(edit.source)} and would take the rows "
                    f"of both {wanted[source]} and {target}; one table row cannot hold both (apply the edit per call "
                    "with StemEditor, or use strategy='mean')"
                )
    copies, freed = table_copies(model), model.base_model.stem_tables.freed
    for copy in copies:
        copy.check_writable()
    if freed and not copies:
        raise ValueError(f"persist_edit: {FREED_TABLES} (an attached engine takes the edit into the rows it serves)")
    model.stem_save_id = unsaved_id()  # the tables no longer hold the loaded or saved checkpoint's rows
    source = list(edit.source)
    for key, table in model.base_model.stem_tables.items():
        if freed:  # the engine's copy is the only one: the edit reads its rows
            rows = edited_rows(lambda ids, layer=int(key): copies[0].read_rows(layer, torch.tensor(ids)), edit)
        else:  # the model's rows, exact, as a rebuilt engine would take them
            write_edited_rows(table.weight, edit)
            rows = table.weight[source]
        for copy in copies:
            copy.write_rows(int(key), torch.tensor(source), rows)


def edited_rows(read: Callable[[list[int]], torch.Tensor], edit: StemEdit) -> torch.Tensor:
    """The float32 rows an edit gives its source tokens, from `read(ids)`, the current rows of `ids`: the mapped
    target's rows (`clone`, `filler`, `subset`) or their mean (`mean`)."""
    if edit.strategy == "mean":
        return read(list(edit.target)).float().mean(dim=0, keepdim=True).expand(len(edit.source), -1)
    return read(list(edit.mapped_target())).float()


@torch.no_grad()
def write_edited_rows(weight: torch.Tensor, edit: StemEdit) -> None:
    """Writes into the `[vocab, width]` matrix `weight` the rows an edit gives its source tokens: the mapped target's
    rows (`clone`, `filler`, `subset`) or their mean (`mean`). Any per-token matrix: a table, or an embedding for
    comparison."""
    weight[list(edit.source)] = edited_rows(lambda ids: weight[ids], edit).to(weight.dtype).clone()


@contextmanager
def persisted(model: nn.Module, edit: StemEdit) -> Iterator[None]:
    """`persist_edit` for the duration of a `with` block, then the source rows and the model's save id exactly as they
    were: to measure what a persisted edit does (to prompts without the source, say) and leave the model unchanged.
    The rows of an attached offload engine's copy are put back too."""
    unwrapped_tables(model, "persisted")  # through PEFT's wrappers a write would go to a merged copy, lost
    check_edits(model, [edit])
    rows = list(edit.source)
    tables = model.base_model.stem_tables
    freed = model.base_model.stem_tables.freed  # then the engine's copy is all persist_edit writes
    saved = {} if freed else {k: t.weight.detach()[rows].clone() for k, t in tables.items()}
    save_id = getattr(model, "stem_save_id", None)
    with ExitStack() as stack:
        for copy in table_copies(model):
            stack.enter_context(copy.kept_rows(torch.tensor(rows)))
        try:
            persist_edit(model, edit)
            yield
        finally:
            with torch.no_grad():
                for k, weights in saved.items():
                    tables[k].weight[rows] = weights
            model.stem_save_id = save_id


@contextmanager
def edited(model: nn.Module, tokenizer, source: str, target: str, strategy: str = "clone") -> Iterator[StemEditor]:
    """`with edited(model, tokenizer, " France", " Germany"): ...`: one text edit as a reversible context."""
    strategy = current_strategy(strategy, stacklevel=3)  # the caller's `with` line, past contextmanager's frame
    with StemEditor(model, [StemEdit.from_text(tokenizer, source, target, strategy)]) as editor:
        yield editor


__all__ = [
    "RENAMED_STRATEGIES",
    "current_strategy",
    "STRATEGIES",
    "StemEdit",
    "StemEditor",
    "StemTableCopy",
    "check_edits",
    "edited",
    "edited_ids",
    "edited_rows",
    "filler_id",
    "find_occurrences",
    "persist_edit",
    "persisted",
    "table_copies",
    "write_edited_rows",
]
