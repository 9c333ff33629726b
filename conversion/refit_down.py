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
    inter, hidden = stem.config.intermediate_size, stem.config.hidden_size
    gram = {layer: torch.zeros(inter, inter, dtype=torch.float64) for layer in layers}
    cross = {layer: torch.zeros(inter, hidden, dtype=torch.float64) for layer in layers}
    tables = stem.model.stem_tables

    def collect(layer, mlp, x, chunk):
        s = mlp.act_fn(mlp.gate_proj(x))
        h = s * tables[str(layer)].weight[chunk].float()
        gram[layer] += (h.T @ h).double()
        cross[layer] += (h.T @ nn.functional.linear(s * mlp.up_proj(x), mlp.down_proj.weight)).double()  # no bias

    run_to_layers(dense, chunks, layers, collect, "refitting W_down")
    for layer in tqdm(layers, desc="solving W_down", unit="layer"):
        weight = stem.model.layers[layer].mlp.down_proj.weight
        lam = ridge * gram[layer].diagonal().mean()
        system = gram[layer] + lam * torch.eye(inter, dtype=torch.float64)
        weight.copy_(torch.linalg.solve(system, cross[layer] + lam * weight.T.double()).T.to(weight.dtype))
