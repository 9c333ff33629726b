"""Closed-form refit of each STEM layer's down-projection, once its table rows are set.

A token-indexed row cannot follow the context the way `W_up x` does, so with the dense `W_down` the layer's output is
off. With the rows fixed, the layer is linear in `W_down`: `y = W_down h`, `h = SiLU(W_gate x) * U[t]`. The refit is the
ridge least-squares `W_down` that maps `h` to the dense FFN's output `W_down (SiLU(W_gate x) * W_up x)` over the
calibration positions (position 0 included, so that the attention sink stays close to dense), shrunk toward the dense
`W_down`. Memory: one `[d_ff, d_ff]` and one `[d_ff, hidden]` fp64 accumulator per STEM layer (26 MB for SmolLM2).
"""

import torch
from torch import nn
from tqdm import tqdm

from .calibrate import run_to_layers
from .feedback import RidgeFit


@torch.inference_mode()
def refit_down(
    dense: nn.Module,
    stem: nn.Module,
    chunks: list[torch.Tensor],
    ridge: float = 1e-2,
) -> None:
    """Sets `stem`'s STEM layers' `down_proj.weight` from calibration `chunks` run through `dense`. `ridge` scales the
    pull toward the dense `W_down`, relative to the mean diagonal of the Gram matrix (0: plain least squares)."""
    if ridge < 0:
        raise ValueError(f"ridge: {ridge} is negative")
    layers = stem.config.stem_layers
    tables = stem.model.stem_tables
    fits = {layer: RidgeFit(stem.model.layers[layer].mlp.down_proj) for layer in layers}

    def collect(layer, mlp, x, chunk):
        s = mlp.act_fn(mlp.gate_proj(x))
        # The target keeps the dense bias, which the fit takes off again: the STEM layer kept that same bias.
        fits[layer].add(s * tables[str(layer)].weight[chunk].float(), mlp.down_proj(s * mlp.up_proj(x)))

    run_to_layers(dense, chunks, layers, collect, "refitting W_down")
    for layer in tqdm(layers, desc="solving W_down", unit="layer"):
        fits[layer].solve(ridge)
