"""Healing: distils the dense model into the converted one (KL divergence between next-token distributions) on
calibration text.

Progressive conversion (`conversion.blend`): the STEM layers start as a blend `a` of the dense FFN and the converted
one. `a` falls linearly from just below 1 (at `a = 1` the tables would get no gradient) to 0 over the first `anneal`
share of the steps, so the model never falls off a cliff; the rest of the budget trains the pure STEM model. The blend
is removed at the end: the result has no `W_up`. An interrupted healing keeps what it trained so far (rows, and weights
trained while `a > 0`).

Rows train at `table_lr` 1e-3 by default, no faster: AdamW moves a row by about `3 lr` per element the first time its
token occurs, and its momentum carries the row on for some ten steps with no gradient, about `30 lr` in all. Ten times
faster, that drift is as large as the converted rows' own entries, and one occurrence overwrites what conversion fit;
the paper trains from scratch on far more text, where every row occurs often.
"""

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from .blend import BlendedStem
from .options import HEAL_PRECISIONS, HEAL_TRAINABLE

__all__ = [
    "ANNEAL",
    "PRECISIONS",
    "TRAINABLE",
    "check_heal_options",
    "distillation_loss",
    "heal",
    "resolve_precision",
]

TRAINABLE = HEAL_TRAINABLE
# What the teacher and student forwards and the backward compute in. Master weights, rows, optimizer state and the KL
# stay fp32 either way. bf16 autocast heals faster where the device computes bf16 natively, to the same held-out
# perplexity (benchmarks/results/bench_conversion_bf16.json), and is the usual choice on a GPU; on a CPU without bf16
# instructions it can be slower, so "auto" takes bf16 only where the device has them (`resolve_precision`).
PRECISIONS = HEAL_PRECISIONS
# The default share of healing that anneals `a` from 1 to 0, by init: a calibrated start is already a better model than
# the blend on the way to it, while a start far from the dense model (`projected`, `xavier`) needs the progressive blend
# so as not to fall off a cliff (benchmarks/results/bench_conversion.json heals `fitted` and `xavier` with these).
ANNEAL = {"fitted": 0.0, "mean": 0.0, "projected": 0.25, "xavier": 0.25}


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
    are clipped to norm 1 for the table rows and the other weights apart (our choice for healing: the paper's training
    script clips every gradient together, as `StemTrainer(recipe="paper")` does; a later version of the reference code
    clips its tables apart, as here).
    `callback(tokens_seen, a, kl)` is called every `log_every` steps with the blend `a` and the recent mean KL, the
    model in eval mode; it is valid for any input then (at `a == 0` it is the STEM model being healed). `precision`
    "bf16" runs the forwards and the backward under bf16 autocast, "auto" does where the device computes bf16 natively
    (`resolve_precision`; the returned `heal_precision` says which ran). Healing runs where `stem`'s embeddings
    are; `dense` must be on the same device. Returns facts for the report."""
    check_heal_options(tokens, train, anneal, table_lr, lr, warmup, log_every, precision=precision)
    if not stem.config.stem_layers:
        raise ValueError("healing: the model has no STEM layers, so there is nothing to heal")
    steps = _steps(chunks, tokens)
    start = time.perf_counter()
    seen = torch.unique(torch.cat(steps))
    device = stem.get_input_embeddings().weight.device
    precision = resolve_precision(precision, device)
    with _frozen(dense, stem) as flags:
        params = [p for p in _trainable(stem, train) if flags[p]]  # what the caller froze stays frozen
        for p in params:
            p.requires_grad_(True)
        with BlendedStem(dense, stem, seen) as blend:
            blend.set_blend(0.0)
            kl_before = _mean_kl(dense, stem, steps[:4], device)  # the pure STEM model, before any training
            groups = [{"params": list(blend.compact.parameters()), "lr": table_lr}]
            if params:
                groups.append({"params": params, "lr": lr})
            optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
            losses = _train(dense, stem, blend, steps, optimizer, anneal, warmup, precision, log_every, callback)
    return {
        "heal_tokens": sum(len(step) for step in steps),
        "heal_steps": len(steps),
        "heal_train": train,
        "heal_anneal": anneal,
        "heal_table_lr": table_lr,
        "heal_lr": lr if params else None,
        "heal_precision": precision,
        "heal_rows": len(seen),
        "heal_kl_before": kl_before,
        "heal_kl_last": _recent(losses, log_every),
        "heal_wall_time_s": time.perf_counter() - start,
    }


def _steps(chunks: list[torch.Tensor], tokens: int) -> list[torch.Tensor]:
    """The chunk of each step, cycling through `chunks`, `tokens` in all."""
    chunks = [c for c in chunks if len(c) >= 2]
    if not chunks or tokens < 2:
        raise ValueError("healing needs calibration text: no chunk holds two tokens")
    steps, total = [], 0
    while total < tokens:
        chunk = chunks[len(steps) % len(chunks)][: tokens - total]
        if len(chunk) < 2:
            break
        steps.append(chunk)
        total += len(chunk)
    return steps


@contextmanager
def _frozen(dense: nn.Module, stem: nn.Module) -> Iterator[dict[nn.Parameter, bool]]:
    """Both models with no parameter trainable, the dense one in eval mode; yields what was trainable. Restores their
    modes and flags on exit, also after an error."""
    was_training = stem.training, dense.training
    flags = {p: p.requires_grad for p in (*dense.parameters(), *stem.parameters())}
    dense.eval().requires_grad_(False)
    stem.requires_grad_(False)
    try:
        yield flags
    finally:
        stem.train(was_training[0])
        dense.train(was_training[1])
        for p, flag in flags.items():
            p.requires_grad_(flag)


def _schedule(steps: int, warmup: float) -> Callable[[int], float]:
    """The learning rate factor at each step: linear warmup over `warmup` of the steps, then a cosine down to 10%."""
    n_warm = max(1, int(warmup * steps))

    def schedule(step: int) -> float:
        if step < n_warm:
            return (step + 1) / n_warm
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - n_warm) / max(1, steps - n_warm - 1)))

    return schedule


def _recent(losses: list[float], log_every: int) -> float:
    return sum(losses[-log_every:]) / len(losses[-log_every:])


def _train(
    dense: nn.Module,
    stem: nn.Module,
    blend: BlendedStem,
    steps: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    anneal: float,
    warmup: float,
    precision: str,
    log_every: int,
    callback: Callable[[int, float, float], None] | None,
) -> list[float]:
    """The healing loop: one chunk per step, the blend annealed over the first `anneal` of the steps. Returns the
    step losses."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(len(steps), warmup))
    n_anneal = math.ceil(anneal * len(steps))
    device = stem.get_input_embeddings().weight.device
    losses, seen_tokens = [], 0
    stem.train()
    bar = tqdm(steps, desc="healing", unit="step")
    for step, ids in enumerate(bar):
        a = max(0.0, 1.0 - (step + 1) / (n_anneal + 1))  # n_anneal steps strictly between 1 and 0
        blend.set_blend(a)
        losses.append(_step(dense, stem, ids[None].to(device), precision, optimizer, scheduler))
        seen_tokens += len(ids)
        if (step + 1) % log_every == 0 or step + 1 == len(steps):
            kl = _recent(losses, log_every)
            bar.set_postfix(kl=f"{kl:.3f}", a=f"{a:.2f}")
            if callback is not None:
                stem.eval()
                callback(seen_tokens, a, kl)
                stem.train()
    return losses


def _step(
    dense: nn.Module,
    stem: nn.Module,
    ids: torch.Tensor,
    precision: str,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> float:
    """One distillation step on `ids` (`[1, length]`); returns its loss."""
    # fp32 opens no autocast context at all: not every device type has one
    bf16 = torch.autocast(ids.device.type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
    with bf16:
        with torch.no_grad():
            teacher = dense(ids, use_cache=False).logits
        student = stem(ids, use_cache=False).logits
    loss = distillation_loss(student, teacher)
    loss.backward()
    for group in optimizer.param_groups:
        torch.nn.utils.clip_grad_norm_(group["params"], 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()
