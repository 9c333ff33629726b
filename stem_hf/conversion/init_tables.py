"""Table rows for a STEM layer converted from a dense one, for each initialization.

- `projected`: `W_up(norm(E[t]))`, from the token embedding alone, no calibration.
- `mean`: `W_up(E[x | t])`, the up-projection of the mean FFN input where the input token is t.
- `fitted`: per channel j, `sum(s_j^2 u_j) / sum(s_j^2)` with `s = SiLU(W_gate x)`, `u = W_up x`: the weighted
  least-squares row for the product `s * u` that feeds `W_down`.
Rare tokens are shrunk (pseudo-count `shrink`) toward, and unseen tokens get, a fallback: the up-projection of a ridge
map from the token's features (its input embedding, and with a prior context its FFN input after that context) to its
mean FFN input. The BOS token gets the exact position-0 row.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from tqdm import tqdm
from transformers.utils import logging

from ..modeling_stem import xavier_normal_std
from .calibrate import LayerStats, calibrate, context_inputs
from .options import CALIBRATED_INITS

__all__ = ["ROW_BLOCK", "calibrated_rows", "init_tables", "layer_groups", "projected_rows", "ridge_map"]

ROW_BLOCK = 4096  # table rows computed at a time: bounds the fp32 working set
logger = logging.get_logger(__name__)


@dataclass
class _Calibration:
    seen: torch.Tensor  # the distinct tokens of the calibration text past position 0
    slots: torch.Tensor  # [vocab] -> row of the statistics' accumulators, -1 for an unseen token
    tokens: int

    def info(self, vocab: int) -> dict:
        """Calibration facts for the report."""
        return {
            "calibration_tokens": self.tokens,
            "distinct_tokens": len(self.seen),
            "vocab_coverage": len(self.seen) / vocab,
        }


def _seen_tokens(chunks: list[torch.Tensor], init: str, vocab: int) -> _Calibration:
    if not chunks:
        raise ValueError(f"init {init!r} needs calibration text (--calibration)")
    ids = torch.cat([c[1:] for c in chunks])
    if len(ids) == 0:
        raise ValueError(f"init {init!r}: the calibration text holds no token past position 0 of its chunks")
    seen = torch.unique(ids)
    slots = torch.full((vocab,), -1, dtype=torch.long)
    slots[seen] = torch.arange(len(seen))
    return _Calibration(seen, slots, sum(len(c) for c in chunks))


def layer_groups(layers: list[int], layer_bytes: int, budget: int | None) -> list[list[int]]:
    """`layers` in order, in groups whose calibration state (`layer_bytes` each) fits `budget` bytes: one group when
    it all fits or no budget is known, one layer a group at worst. Each group costs a pass over the calibration text
    (and the vocabulary, with a prior context); the rows do not depend on the grouping."""
    size = len(layers) if budget is None else max(1, min(len(layers), budget // max(1, layer_bytes)))
    return [layers[i : i + size] for i in range(0, len(layers), size)]


@torch.inference_mode()
def init_tables(
    dense: nn.Module,
    stem: nn.Module,
    init: str,
    chunks: list[torch.Tensor],
    shrink: float = 16.0,
    ridge: float = 1e-2,
    layers: list[int] | None = None,
    prior_prefix: list[int] | None = None,
    write: Callable[[int, int, torch.Tensor], None] | None = None,
    memory_budget: int | None = None,
) -> dict:
    """Sets every table of `stem` (or those of `layers`) from `dense`, `ROW_BLOCK` rows at a time, each block cast to
    the table dtype and handed to `write(layer, first_row, rows)` (default: into the model's table; a conversion that
    streams its tables to disk passes `StemTableStream.write`). Returns calibration facts for the report.
    `prior_prefix` (token ids, for `mean` and `fitted`): the fallback that rare and unseen tokens' rows lean on is a
    ridge map from the token's input embedding and its FFN input after this prefix (`context_inputs`), not from the
    embedding alone. `memory_budget` (bytes; default: no limit): the calibrated inits hold their statistics (and
    prior-context inputs) for as many layers at a time as fit it (`layer_groups`), at the cost of a pass over the text
    per group."""
    layers = stem.config.stem_layers if layers is None else layers
    vocab, width = stem.config.vocab_size, stem.config.intermediate_size
    dtype = stem.config.torch_table_dtype
    write = write or partial(_write_into, stem.model.stem_tables)
    uncalibrated = {"calibration_tokens": 0, "distinct_tokens": 0, "vocab_coverage": 0.0}
    if not layers:
        return uncalibrated
    if init == "xavier":  # the paper's init, drawn a block at a time from torch's generator
        std = xavier_normal_std(vocab, width)
        for layer in tqdm(layers, desc="xavier tables", unit="layer"):
            _fill(partial(write, layer), vocab, dtype, lambda rows: torch.randn(rows.stop - rows.start, width) * std)
        return uncalibrated
    embed = dense.get_input_embeddings().weight.detach()
    if init not in CALIBRATED_INITS:
        for layer in tqdm(layers, desc=f"{init} tables", unit="layer"):
            block = dense.model.layers[layer]
            _fill(partial(write, layer), vocab, dtype, lambda rows: projected_rows(block, embed, rows))  # noqa: B023
        return uncalibrated
    calibration = _seen_tokens(chunks, init, vocab)
    hidden = dense.config.hidden_size
    layer_bytes = 4 * (len(calibration.seen) * (hidden + (2 * width if init == "fitted" else 0)))
    layer_bytes += 4 * vocab * hidden if prior_prefix is not None else 0  # the layer's FFN inputs after the prefix
    groups = layer_groups(layers, layer_bytes, memory_budget)
    if len(groups) > 1:
        logger.warning(
            f"calibrating {len(layers)} layers in {len(groups)} groups of at most {len(groups[0])}, one pass over the "
            "text each: their statistics at once would not fit half the memory available"
        )
    if prior_prefix is not None:
        embed_features = embed[:vocab].float().cpu()  # beside each layer's context inputs, which live on the CPU
    bos = stem.config.bos_token_id if all(c[0] == stem.config.bos_token_id for c in chunks) else None
    for group in groups:
        stats = features = context = all_stats = None  # the last group's, freed before this one's are gathered
        all_stats = calibrate(dense, chunks, group, calibration.slots.clamp(min=0), init == "fitted")
        context = context_inputs(dense, group, prior_prefix, vocab) if prior_prefix is not None else None
        for layer in tqdm(group, desc=f"{init} tables", unit="layer"):
            stats = all_stats.pop(layer)
            features = embed if context is None else torch.cat([embed_features, context.pop(layer)], dim=1)
            mean_x = stats.sum_x[: len(calibration.seen)] / stats.count[: len(calibration.seen), None].clamp(min=1)
            fallback = ridge_map(features, calibration.seen, mean_x, stats.count, ridge)
            mlp, slots = dense.model.layers[layer].mlp, calibration.slots

            def rows_of(rows: slice) -> torch.Tensor:
                return calibrated_rows(mlp, stats, slots, fallback, features, rows, init, shrink, bos)  # noqa: B023

            _fill(partial(write, layer), vocab, dtype, rows_of)
    return calibration.info(vocab)


def _write_into(tables: nn.ModuleDict, layer: int, first_row: int, rows: torch.Tensor) -> None:
    tables[str(layer)].weight[first_row : first_row + len(rows)] = rows


def _fill(
    write: Callable[[int, torch.Tensor], None], vocab: int, dtype: torch.dtype, rows_of: Callable[[slice], torch.Tensor]
) -> None:
    """Hands `write(first_row, rows)` a table's rows block by block, computed in fp32 by `rows_of(rows)` and cast to
    `dtype`."""
    for start in range(0, vocab, ROW_BLOCK):
        rows = slice(start, min(start + ROW_BLOCK, vocab))
        write(start, rows_of(rows).to(dtype))


def ridge_map(
    features: torch.Tensor, tokens: torch.Tensor, mean_x: torch.Tensor, counts: torch.Tensor, lam: float
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Affine map `[F, 1] @ A` fit by count-weighted ridge regression from the features `F` (`[vocab, n]`) of seen
    `tokens` to their mean FFN inputs. Returns a function of features."""
    features = torch.cat([features[tokens].double(), torch.ones(len(tokens), 1, dtype=torch.float64)], dim=1)
    weighted = features * counts.double()[:, None]
    gram = features.T @ weighted
    gram += lam * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=torch.float64)
    solution = torch.linalg.solve(gram, weighted.T @ mean_x.double()).float()
    return lambda e: e.float() @ solution[:-1] + solution[-1]


def _up(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return mlp.up_proj(x)


@torch.inference_mode()
def projected_rows(layer: nn.Module, embed: torch.Tensor, rows: slice) -> torch.Tensor:
    """Rows `rows` of the `projected` table of the dense decoder layer `layer`, from the token embeddings `embed`."""
    return _up(layer.mlp, layer.post_attention_layernorm(embed[rows].float()))


@torch.inference_mode()
def calibrated_rows(
    mlp: nn.Module,
    stats: LayerStats,
    slots: torch.Tensor,
    fallback_x: Callable[[torch.Tensor], torch.Tensor],
    features: torch.Tensor,
    rows: slice,
    init: str,
    shrink: float,
    bos_token_id: int | None,
) -> torch.Tensor:
    """Rows `rows` of the table for `init` in ("mean", "fitted"); `features`: `[vocab, n]`, what `fallback_x` maps."""
    token_ids = torch.arange(features.shape[0])[rows]
    slot = slots[rows]
    seen = slot >= 0
    prior_x = fallback_x(features[rows])  # [n, hidden]
    if init == "mean":
        count = torch.zeros(len(slot))
        sum_x = torch.zeros_like(prior_x)
        count[seen] = stats.count[slot[seen]]
        sum_x[seen] = stats.sum_x[slot[seen]]
        out = _up(mlp, (sum_x + shrink * prior_x) / (count + shrink).clamp(min=1e-12)[:, None])
        out[~seen] = _up(mlp, prior_x[~seen])
    else:
        prior = _up(mlp, prior_x)
        # The pseudo-count is in occurrences: `shrink` times the mean weight one occurrence carries, per channel.
        if stats.mean_w is None:  # once per layer, not per block of rows
            stats.mean_w = stats.sum_w.sum(0) / stats.count.sum().clamp(min=1)
        mean_w = stats.mean_w
        sum_w = torch.zeros_like(prior)
        sum_wu = torch.zeros_like(prior)
        sum_w[seen] = stats.sum_w[slot[seen]]
        sum_wu[seen] = stats.sum_wu[slot[seen]]
        out = (sum_wu + shrink * mean_w * prior) / (sum_w + shrink * mean_w).clamp(min=1e-12)
        out[~seen] = prior[~seen]
    if bos_token_id is not None and stats.first_count and rows.start <= bos_token_id < rows.stop:
        at = int((token_ids == bos_token_id).nonzero())
        if init == "mean":
            out[at] = _up(mlp, stats.first_x / stats.first_count)
        else:
            out[at] = stats.first_wu / stats.first_w.clamp(min=1e-12)
    return out
