"""Progressive conversion during healing: the converted model blended with the dense one it came from, and its table
rows trained as compact copies.

Each STEM layer computes `W_d(SiLU(W_g x) * (a W_up x + (1 - a) U[t]))`, the dense up-projection borrowed from the
source (and `W_d` and `W_g` blended likewise from the dense ones to the refit and trained ones, `StemBlendMLP`; so are
the other weights conversion changed, `StemBlendWeight`). At `a = 1` the model is exactly the dense one, at `a = 0` the
STEM one.

Only the rows of tokens that occur in the healing text ever get a gradient, so those rows train as one compact fp32
copy per table (`StemCompactTable`: `[distinct tokens, d_ff]`, with optimizer state for those rows alone) and are
written back into the tables at the end: optimizer state over full fp32 tables would cost several times the tables.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

__all__ = ["BlendedStem", "StemBlendMLP", "StemBlendWeight", "StemCompactTable"]


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
    layers' FFNs: `conversion.refit`): `a * source + (1 - a) * weight`, so that at `a = 1` a freshly converted model
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
