"""Per-token statistics of each STEM layer's dense FFN input, from running the dense model over calibration text.

Streaming and bounded: accumulators hold one row per distinct calibration token (not per vocabulary entry), per chosen
layer only, and the forward stops after the last chosen layer. Position 0 (the attention sink, a BOS token when the
tokenizer has one) is kept apart: its FFN input is a function of that token alone, so it gets an exact row.
"""

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import DynamicCache

from ..compat_stem import CACHE_ARG
from .hooks import StopForward, run_until

__all__ = ["LayerStats", "calibrate", "context_inputs", "run_to_layers"]


@dataclass
class LayerStats:
    count: torch.Tensor  # [slots] occurrences at positions >= 1
    sum_x: torch.Tensor  # [slots, hidden] summed FFN inputs
    sum_w: torch.Tensor | None  # [slots, intermediate] summed SiLU(gate)^2: the weights of the fitted rows
    sum_wu: torch.Tensor | None  # [slots, intermediate] summed SiLU(gate)^2 * up
    first_x: torch.Tensor  # [hidden] summed FFN input at position 0
    first_w: torch.Tensor | None  # [intermediate]
    first_wu: torch.Tensor | None  # [intermediate]
    first_count: int = 0
    mean_w: torch.Tensor | None = None  # [intermediate] mean SiLU(gate)^2 per occurrence, filled by init_tables


def run_to_layers(
    model: torch.nn.Module,
    chunks: list[torch.Tensor],
    layers: list[int],
    collect: Callable[[int, torch.nn.Module, torch.Tensor, torch.Tensor], None],
    desc: str,
) -> None:
    """Runs `model` over each chunk and calls `collect(layer, mlp, ffn_input [seq, hidden], chunk)` at the FFN of each
    of `layers`; the forward stops after the last of them (nothing after it is needed)."""
    last = max(layers)

    def hook(layer):
        mlp = model.model.layers[layer].mlp

        def pre_forward(module, args):
            collect(layer, mlp, args[0][0].float(), current[0])
            if layer == last:
                raise StopForward

        return mlp.register_forward_pre_hook(pre_forward)

    current = [None]

    def forward(chunk):
        current[0] = chunk
        model(chunk[None], use_cache=False)

    run_until(forward, tqdm(chunks, desc=desc, unit="chunk"), [hook(layer) for layer in layers])


@torch.inference_mode()
def calibrate(
    model: torch.nn.Module,
    chunks: list[torch.Tensor],
    layers: list[int],
    slots: torch.Tensor,
    fitted: bool,
) -> dict[int, LayerStats]:
    """`chunks`: 1-D token id tensors, each run as one sequence. `slots`: [vocab] -> accumulator row (-1: unseen)."""
    n_slots = int(slots.max()) + 1
    hidden, inter = model.config.hidden_size, model.config.intermediate_size

    def zeros(*shape):
        return torch.zeros(*shape, dtype=torch.float32)

    stats = {
        layer: LayerStats(
            count=zeros(n_slots),
            sum_x=zeros(n_slots, hidden),
            sum_w=zeros(n_slots, inter) if fitted else None,
            sum_wu=zeros(n_slots, inter) if fitted else None,
            first_x=zeros(hidden),
            first_w=zeros(inter) if fitted else None,
            first_wu=zeros(inter) if fitted else None,
        )
        for layer in layers
    }

    def collect(layer, mlp, x, chunk):
        s = stats[layer]
        rest = slots[chunk][1:]
        s.count.index_add_(0, rest, torch.ones(len(rest)))
        s.sum_x.index_add_(0, rest, x[1:])
        s.first_x += x[0]
        s.first_count += 1
        if fitted:
            w = mlp.act_fn(mlp.gate_proj(x)).pow(2)
            wu = w * mlp.up_proj(x)
            s.sum_w.index_add_(0, rest, w[1:])
            s.sum_wu.index_add_(0, rest, wu[1:])
            s.first_w += w[0]
            s.first_wu += wu[0]

    run_to_layers(model, chunks, layers, collect, "calibrating")
    return stats


@torch.inference_mode()
def context_inputs(
    model: torch.nn.Module, layers: list[int], prefix: list[int], vocab_size: int, positions: int = 4096
) -> dict[int, torch.Tensor]:
    """`{layer: [vocab_size, hidden]}` on the CPU: each of `layers`' FFN input at token t when `model` reads `prefix`
    then t, for every token t. The prefix's keys and values are computed once and repeated for each batch of tokens,
    one new position per token; the forward stops after the last of `layers`. A batch holds about `positions` cached
    positions per layer. Memory: `vocab_size x hidden` fp32 values per layer."""
    device = model.get_input_embeddings().weight.device
    inputs = {layer: torch.zeros(vocab_size, model.config.hidden_size) for layer in layers}
    prefix_cache = DynamicCache(config=model.config)
    model(torch.tensor([prefix], device=device), use_cache=True, **{CACHE_ARG: prefix_cache})
    last, offset = max(layers), [0]

    def hook(layer):
        def pre_forward(module, args):
            inputs[layer][offset[0] : offset[0] + len(args[0])] = args[0][:, -1].float().cpu()
            if layer == last:
                raise StopForward

        return model.model.layers[layer].mlp.register_forward_pre_hook(pre_forward)

    batch = max(1, positions // (len(prefix) + 1))

    def forward(start):
        offset[0] = start
        tokens = torch.arange(start, min(start + batch, vocab_size), device=device)
        cache = copy.deepcopy(prefix_cache)  # the forward appends to it and repeats it in place
        cache.batch_repeat_interleave(len(tokens))
        model(tokens[:, None], use_cache=True, **{CACHE_ARG: cache})

    starts = tqdm(range(0, vocab_size, batch), desc="context inputs", unit="batch")
    run_until(forward, starts, [hook(layer) for layer in layers])
    return inputs
