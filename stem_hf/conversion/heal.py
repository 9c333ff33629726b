"""Healing: distils the dense model into the converted one (KL divergence between next-token distributions) on
calibration text.

Progressive conversion: during healing each STEM layer computes `W_d(SiLU(W_g x) * (a W_up x + (1 - a) U[t]))`, the
dense up-projection borrowed from the source (and `W_d` and `W_g` blended likewise from the dense ones to the refit and
trained ones, see `StemBlendMLP`; so are the other weights conversion changed, see `StemBlendWeight`). At `a = 1` the
model is exactly the dense one; `a` falls linearly from just below 1 (at `a = 1` the tables would get no gradient) to 0
over the first `anneal` share of the steps, so the model never falls off a cliff; the rest of the budget trains the pure
STEM model. The blend is removed at the end: the result has no `W_up`. An interrupted healing keeps what it trained so
far (rows, and weights trained while `a > 0`).

Rows train at `table_lr` 1e-3 by default, no faster: AdamW moves a row by about `3 lr` per element the first time its
token occurs, and its momentum carries the row on for some ten steps with no gradient, about
`30 lr` in all. At 1e-2 that is the size of the rows themselves (mean |U| 0.27 for SmolLM2), and one occurrence
overwrites what conversion fit; the paper trains from scratch on far more text, where every row occurs often.

Memory: only the rows of tokens that occur in the healing text ever get a gradient, so those rows train as one compact
fp32 copy per table (`[distinct tokens, d_ff]`, with AdamW state for those rows alone) and are written back into the
tables at the end. Dense AdamW over full fp32 tables would cost ~1.2 GB per SmolLM2 layer.
"""

import math
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from tqdm import tqdm

from .options import HEAL_PRECISIONS, HEAL_TRAINABLE

TRAINABLE = HEAL_TRAINABLE
# What the teacher and student forwards and the backward compute in. Master weights, rows, optimizer state and the KL
# stay fp32 either way. bf16 autocast heals SmolLM2-1/3 1.78x as fast on a CPU with AVX512-BF16, to the same held-out
# perplexity (benchmarks/results/bench_conversion_bf16.json), and is the usual choice on a GPU; on a CPU without bf16
# instructions it can be slower, so "auto" takes bf16 only where the device has them (`resolve_precision`).
PRECISIONS = HEAL_PRECISIONS
# The default share of healing that anneals `a` from 1 to 0, by init: a calibrated start is already a better model than
# the blend on the way to it (from SmolLM2-1/3 `fitted`, 20k tokens: 1.61x dense perplexity with no anneal, 1.64x with
# 0.25), while a start far from the dense model (11.9x for `xavier`) needs the progressive blend so as not to fall off
# a cliff.
ANNEAL = {"fitted": 0.0, "mean": 0.0, "projected": 0.25, "xavier": 0.25}


class StemBlendMLP(nn.Module):
    """A STEM layer's FFN during healing: `down_a(SiLU(gate_a(x)) * (a * up(x) + (1 - a) * rows))`, `up` and the dense
    `gate` and `down` borrowed from the source, `down_a = a * down + (1 - a) * down_proj` and `gate_a` likewise
    (conversion may have refit `down_proj` and trained `gate_proj`). At `a = 1` it is the dense FFN exactly. Shares
    `gate_proj` and `down_proj` with the STEM layer it stands in for, so that training them trains the STEM model."""

    def __init__(self, mlp: nn.Module, dense_mlp: nn.Module):
        super().__init__()
        self.gate_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.down_proj, mlp.act_fn
        self.dense = (dense_mlp,)  # a tuple: not a submodule, its weights are not this model's
        self.blend = 1.0

    def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        up = rows.to(device=x.device, dtype=x.dtype)
        a = self.blend
        if a == 0:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * up)
        dense = self.dense[0]
        up = a * dense.up_proj(x) + (1.0 - a) * up
        gate = F.linear(x, *_blend(a, dense.gate_proj, self.gate_proj))
        return F.linear(self.act_fn(gate) * up, *_blend(a, dense.down_proj, self.down_proj))


def _blend(a: float, source: nn.Linear, linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(weight, bias)` of `a * source + (1 - a) * linear`."""
    weight = a * source.weight + (1.0 - a) * linear.weight
    return weight, None if linear.bias is None else a * source.bias + (1.0 - a) * linear.bias


class StemBlendWeight(nn.Module):
    """A parametrization of a weight conversion refit or trained outside the STEM FFNs (attention `o_proj`, the dense
    layers' FFNs: `conversion.feedback`): `a * source + (1 - a) * weight`, so that at `a = 1` a freshly converted model
    is the source. Gradients reach the refit weight itself, scaled by `1 - a`."""

    def __init__(self, source: torch.Tensor):
        super().__init__()
        self.source = (source,)  # a tuple: not a buffer of the model it parametrizes
        self.blend = 1.0

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        a = self.blend
        return weight if a == 0 else a * self.source[0] + (1.0 - a) * weight


class StemCompactTable(nn.Module):
    """Stands in for a table during healing: the rows of `tokens` as one trainable fp32 `weight`
    (`[len(tokens), d_ff]`, on `device`), every other row read from the frozen table. So the model stays valid for any
    input (held-out text can be evaluated mid-healing) while optimizer state exists for the trained rows only."""

    def __init__(self, table: nn.Embedding, tokens: torch.Tensor, device: torch.device):
        super().__init__()
        self.frozen = (table,)  # a tuple: not a submodule, so its parameter stays out of this module's
        self.weight = nn.Parameter(table.weight[tokens.to(table.weight.device)].to(device, torch.float32))
        slots = torch.full((table.num_embeddings,), -1, dtype=torch.long, device=device)
        slots[tokens.to(device)] = torch.arange(len(tokens), device=device)
        self.slots = nn.Buffer(slots, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        slot = self.slots[ids]
        rows = self.weight[slot.clamp(min=0)]
        missing = slot < 0
        if not missing.any():  # healing text: every token has a trained row
            return rows
        table = self.frozen[0]
        rest = torch.zeros_like(rows)
        rest[missing] = table(ids[missing].to(table.weight.device)).to(rows)
        return torch.where(missing.unsqueeze(-1), rest, rows)


class BlendedStem:
    """Context manager: `stem`'s STEM layers compute the blend with `dense`'s gate, up- and down-projections, the other
    weights and biases conversion changes (every `o_proj`, the dense layers' FFNs) are blended with `dense`'s where they
    differ (`StemBlendWeight`), and the rows of `tokens` in `stem`'s tables train as compact fp32 copies
    (`StemCompactTable`).
    On exit the trained rows are written back into the tables and the STEM layers and weights are restored, also after
    an error."""

    def __init__(self, dense: nn.Module, stem: nn.Module, tokens: torch.Tensor):
        self.dense, self.stem, self.tokens = dense, stem, tokens
        self.saved, self.mlps, self.compact, self.weights = {}, [], nn.ModuleList(), []

    def __enter__(self) -> "BlendedStem":
        layers, tables = self.stem.model.layers, self.stem.model.stem_tables
        device = self.stem.get_input_embeddings().weight.device
        try:
            for key, table in list(tables.items()):
                layer = int(key)
                blend = StemBlendMLP(layers[layer].mlp, self.dense.model.layers[layer].mlp)
                compact = StemCompactTable(table, self.tokens, device)
                self.saved[key] = (table, layers[layer].mlp)
                layers[layer].mlp, tables[key] = blend, compact
                self.mlps.append(blend)
                self.compact.append(compact)
            # What the refit changes: every o_proj, the dense layers' FFNs (the STEM layers' are StemBlendMLP's). Other
            # weights a second healing may find changed stay as they are: blending one of two tied weights would untie
            # them.
            refit = [f"model.layers.{i}.self_attn.o_proj" for i in range(len(layers))]
            refit += [
                f"model.layers.{i}.mlp.{name}"
                for i in range(len(layers))
                if str(i) not in tables
                for name in ("gate_proj", "up_proj", "down_proj")
            ]
            sources, modules = dict(self.dense.named_modules()), dict(self.stem.named_modules())
            for name in refit:
                module, source = modules[name], sources.get(name)
                if not isinstance(source, nn.Linear):
                    continue
                for tensor in ("weight", "bias"):  # local training changes the dense FFNs' biases too
                    ours, theirs = getattr(module, tensor), getattr(source, tensor)
                    if theirs is not None and not torch.equal(ours, theirs):
                        blend = StemBlendWeight(theirs)
                        parametrize.register_parametrization(module, tensor, blend)
                        self.weights.append((module, tensor, blend))
        except BaseException:
            self._restore(write_back=False)
            raise
        return self

    def set_blend(self, a: float) -> None:
        for blend in (*self.mlps, *(blend for *_, blend in self.weights)):
            blend.blend = a

    def __exit__(self, *exc) -> None:
        self._restore(write_back=True)

    def _restore(self, write_back: bool) -> None:
        layers, tables = self.stem.model.layers, self.stem.model.stem_tables
        try:
            if write_back:
                with torch.no_grad():
                    for key, (table, _) in self.saved.items():
                        tokens = self.tokens.to(table.weight.device)
                        table.weight[tokens] = tables[key].weight.to(table.weight)
        finally:
            for key, (table, mlp) in self.saved.items():
                layers[int(key)].mlp, tables[key] = mlp, table
            for module, tensor, _ in self.weights:  # the refit weight, as trained, is the module's weight again
                parametrize.remove_parametrizations(module, tensor, leave_parametrized=False)
            self.weights.clear()


def _trainable(stem: nn.Module, train: str) -> list[nn.Parameter]:
    """The STEM model's parameters that `train` names (tables aside: they train as compact copies)."""
    if train == "tables":
        return []
    if train == "ffn":
        layers = stem.model.layers
        return [
            p
            for i in stem.config.stem_layers
            for p in (*layers[i].mlp.gate_proj.parameters(), *layers[i].mlp.down_proj.parameters())
        ]
    tables = {id(p) for p in stem.model.stem_tables.parameters()}
    return [p for p in stem.parameters() if id(p) not in tables]


def check_heal_options(
    tokens: int,
    train: str = "all",
    anneal: float = 0.25,
    table_lr: float = 1e-3,
    lr: float = 1e-4,
    warmup: float = 0.05,
    log_every: int = 10,
    callback: Callable[[int, float, float], None] | None = None,
    device: str | torch.device | None = None,
    precision: str = "fp32",
) -> None:
    """Raises on options `heal` would refuse, so that a conversion fails before its calibration, not after."""
    if tokens < 0 or tokens == 1:
        raise ValueError(f"heal tokens: {tokens} is not 0 (no healing) or at least 2 (one prediction)")
    if train not in TRAINABLE:
        raise ValueError(f"heal train: {train!r} is not one of {', '.join(TRAINABLE)}")
    for name, share in (("anneal", anneal), ("warmup", warmup)):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"heal {name}: {share} is not a share of the healing steps in [0, 1]")
    if precision not in PRECISIONS:
        raise ValueError(f"heal precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    if table_lr <= 0 or lr < 0:
        raise ValueError(f"heal learning rates: table_lr {table_lr} must be > 0 and lr {lr} >= 0")
    if log_every < 1:
        raise ValueError(f"heal log_every: {log_every} must be at least 1")
    if callback is not None and not callable(callback):
        raise ValueError(f"heal callback: {callback!r} is not callable (it gets tokens seen, blend a and recent KL)")
    if device is not None:
        try:
            torch.empty(0, device=device)  # an unknown or absent device fails here, not after calibration
        except (RuntimeError, AssertionError) as error:  # CPU-only builds assert on CUDA
            raise ValueError(f"heal device: {device!r} is not usable here ({error})") from error


def resolve_precision(precision: str, device: str | torch.device) -> str:
    """`precision`, with "auto" resolved for `device`: "bf16" on a GPU that supports it or a CPU with AVX512-BF16 or AMX
    instructions, "fp32" elsewhere."""
    if precision != "auto":
        return precision
    device = torch.device(device)
    if device.type == "cuda":
        with torch.cuda.device(device):  # the healing device, not the current one; V100s and T4s only emulate bf16
            native = torch.cuda.is_bf16_supported(including_emulation=False)
    elif device.type == "cpu":
        native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    else:
        native = False
    return "bf16" if native else "fp32"


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student) on the next-token distributions."""
    student = F.log_softmax(student_logits.float().flatten(0, -2), dim=-1)
    teacher = F.log_softmax(teacher_logits.float().flatten(0, -2), dim=-1)
    return F.kl_div(student, teacher, log_target=True, reduction="batchmean")


@torch.no_grad()
def _mean_kl(dense: nn.Module, stem: nn.Module, chunks: list[torch.Tensor], device: torch.device) -> float:
    kls = [distillation_loss(stem(c[None].to(device)).logits, dense(c[None].to(device)).logits) for c in chunks]
    return torch.stack(kls).mean().item()


def heal(
    dense: nn.Module,
    stem: nn.Module,
    chunks: list[torch.Tensor],
    tokens: int,
    anneal: float = 0.25,
    train: str = "all",
    table_lr: float = 1e-3,
    lr: float = 1e-4,
    warmup: float = 0.05,
    log_every: int = 10,
    callback: Callable[[int, float, float], None] | None = None,
    precision: str = "fp32",
) -> dict:
    """Trains `stem` (in place) to match `dense` on `chunks` (1-D token id tensors, cycled) for `tokens` tokens, one
    chunk per step. `train`: "tables" (tables only), "ffn" (tables plus the STEM layers' gate and down projections) or
    "all" (every weight). Learning rates warm up over `warmup` of the steps, then decay on a cosine to 10%; gradients
    are clipped to norm 1 for the table rows and the other weights apart (as the paper's code clips its tables).
    `callback(tokens_seen, a, kl)` is called every `log_every` steps with the blend `a` and the recent mean KL, the
    model in eval mode; it is valid for any input then (at `a == 0` it is the STEM model being healed). `precision`
    "bf16" runs the forwards and the backward under bf16 autocast, "auto" does where the device computes bf16 natively
    (`resolve_precision`; the returned `heal_precision` says which ran). Healing runs where `stem`'s embeddings
    are; `dense` must be on the same device. Returns facts for the report."""
    check_heal_options(tokens, train, anneal, table_lr, lr, warmup, log_every, precision=precision)
    if not stem.config.stem_layers:
        raise ValueError("healing: the model has no STEM layers, so there is nothing to heal")
    chunks = [c for c in chunks if len(c) >= 2]
    if not chunks or tokens < 2:
        raise ValueError("healing needs calibration text: no chunk holds two tokens")
    steps, total = [], 0  # the chunks of each step, cycling through the text, `tokens` in all
    while total < tokens:
        chunk = chunks[len(steps) % len(chunks)][: tokens - total]
        if len(chunk) < 2:
            break
        steps.append(chunk)
        total += len(chunk)
    start = time.perf_counter()
    was_training = stem.training, dense.training
    flags = {p: p.requires_grad for p in (*dense.parameters(), *stem.parameters())}
    dense.eval().requires_grad_(False)
    stem.requires_grad_(False)
    params = [p for p in _trainable(stem, train) if flags[p]]  # what the caller froze stays frozen
    for p in params:
        p.requires_grad_(True)
    seen = torch.unique(torch.cat(steps))
    device = stem.get_input_embeddings().weight.device
    precision = resolve_precision(precision, device)
    losses, seen_tokens = [], 0
    try:
        with BlendedStem(dense, stem, seen) as blend:
            blend.set_blend(0.0)
            kl_before = _mean_kl(dense, stem, steps[:4], device)  # the pure STEM model, before any training
            groups = [{"params": list(blend.compact.parameters()), "lr": table_lr}]
            if params:
                groups.append({"params": params, "lr": lr})
            optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
            n, n_warm = len(steps), max(1, int(warmup * len(steps)))

            def schedule(step: int) -> float:
                if step < n_warm:
                    return (step + 1) / n_warm
                return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - n_warm) / max(1, n - n_warm - 1)))

            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
            n_anneal = math.ceil(anneal * n)
            stem.train()
            bar = tqdm(steps, desc="healing", unit="step")
            for step, ids in enumerate(bar):
                a = max(0.0, 1.0 - (step + 1) / (n_anneal + 1))  # n_anneal steps strictly between 1 and 0
                blend.set_blend(a)
                ids = ids[None].to(device)
                # fp32 opens no autocast context at all: not every device type has one
                bf16 = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
                with bf16:
                    with torch.no_grad():
                        teacher = dense(ids, use_cache=False).logits
                    student = stem(ids, use_cache=False).logits
                loss = distillation_loss(student, teacher)
                loss.backward()
                for group in groups:
                    torch.nn.utils.clip_grad_norm_(group["params"], 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
                seen_tokens += ids.shape[1]
                if (step + 1) % log_every == 0 or step + 1 == n:
                    kl = sum(losses[-log_every:]) / len(losses[-log_every:])
                    bar.set_postfix(kl=f"{kl:.3f}", a=f"{a:.2f}")
                    if callback is not None:
                        stem.eval()
                        callback(seen_tokens, a, kl)
                        stem.train()
    finally:
        stem.train(was_training[0])
        dense.train(was_training[1])
        for p, flag in flags.items():
            p.requires_grad_(flag)
    return {
        "heal_tokens": total,
        "heal_steps": len(steps),
        "heal_train": train,
        "heal_anneal": anneal,
        "heal_table_lr": table_lr,
        "heal_lr": lr if params else None,
        "heal_precision": precision,
        "heal_rows": len(seen),
        "heal_kl_before": kl_before,
        "heal_kl_last": sum(losses[-log_every:]) / len(losses[-log_every:]),
        "heal_wall_time_s": time.perf_counter() - start,
    }
