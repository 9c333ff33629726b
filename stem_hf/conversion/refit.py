"""Closed-form refit of the converted model's output projections, once its table rows are set.

A token-indexed row cannot follow the context the way `W_up x` does, so each STEM layer's FFN output is off, and the
layers after it see drifted inputs. With the rows fixed, a projection's output is linear in its weight: the refit is the
ridge least-squares weight (shrunk toward the current one, `RidgeFit`) from what the projection multiplies to what it
should add to the residual stream for the converted stream to match the dense one:

- a STEM layer's `W_down`: `y = W_down h`, `h = SiLU(W_gate x) * U[t]`, target the dense residual after the layer minus
  the converted residual before the FFN. Over the calibration positions, position 0 included, so that the attention
  sink stays close to dense.
- with `"all"`, after the first STEM layer also every attention `o_proj` (target: the dense residual after attention
  minus the converted residual before it) and every dense layer's `W_down`. These layers compute context-dependent
  features the tables lack, and spend a little of their capacity on undoing the drift.
- with `gate_epochs`, each STEM layer's gate is then trained locally toward the same target (`train_gate`), and `W_down`
  refit once more to the trained gate: the gate is the only part of a STEM FFN that sees the context, so it can learn
  some of what the row cannot. `dense_epochs` does the same for the gate and up-projection of each dense layer that
  `"all"` refits.

Both models' residual streams over the calibration chunks are held in memory and advanced one decoder layer at a time
by the layers' own forwards (`Stream`); hooks read what each projection multiplies. The modes differ in the stream the
converted layers read: `"plain"` hands each STEM layer the dense stream (its `W_down` then maps the dense model's
activations to the dense FFN's output, whatever the other layers do); `"sequential"` and `"all"` hand it over at the
first STEM layer only, then follow the converted model's own, so that each solve sees the inputs its layer will see at
inference, the layers before it already refit.

Memory, in the models' dtype: the two streams plus, during one layer, the dense stream after attention, about
`3 x calibration tokens x hidden` values, and one fp64 `d_ff x (d_ff + hidden)` system at a time; local training adds
the layer's FFN inputs and targets and its rows (in the table's dtype), `2 x hidden + d_ff` values per calibration
token, and fp32 copies of the inputs and targets. Compute: one forward of each model over the calibration text, plus in
each refit layer a second pass up to its `W_down` (and one up to `o_proj` where that is refit), plus the Gram
matrices, plus the local training's epochs.
"""

import torch
from torch import nn
from tqdm import tqdm

from .hooks import StopForward, capture_inputs
from .options import REFITS, check_epochs

__all__ = ["REFIT_MODES", "RidgeFit", "Stream", "refit", "train_gate"]

REFIT_MODES = tuple(mode for mode in REFITS if mode != "none")


class RidgeFit:
    """Accumulates `features -> target` over chunks, then sets `linear.weight` to the ridge solution shrunk toward it.
    The bias, if any, stays: it is subtracted from the target."""

    def __init__(self, linear: nn.Linear):
        self.linear = linear
        n_in, n_out = linear.in_features, linear.out_features
        self.gram = torch.zeros(n_in, n_in, dtype=torch.float64)
        self.cross = torch.zeros(n_in, n_out, dtype=torch.float64)

    def add(self, features: torch.Tensor, target: torch.Tensor) -> None:
        features, target = features.float(), target.float()
        if self.linear.bias is not None:
            target = target - self.linear.bias.float()
        self.gram += (features.T @ features).double().cpu()
        self.cross += (features.T @ target).double().cpu()

    def solve(self, ridge: float) -> None:
        """`ridge` scales the pull toward the current weight, relative to the mean diagonal of the Gram matrix."""
        weight = self.linear.weight
        lam = ridge * self.gram.diagonal().mean()
        self.gram.diagonal().add_(lam)  # in place: the Gram matrix is the largest tensor of a solve
        solution = torch.linalg.solve(self.gram, self.cross + lam * weight.T.double().cpu())
        weight.copy_(solution.T.to(weight.device, weight.dtype))


class Stream:
    """One model's residual stream over the calibration chunks, advanced one decoder layer at a time by the layer's
    own forward, with the arguments the model's forward gives its layers (mask, positions, rotary embeddings, rows)."""

    def __init__(self, model: nn.Module, chunks: list[torch.Tensor]):
        self.layers = model.model.layers
        self.dtype = model.get_input_embeddings().weight.dtype
        self.hidden, self.kwargs = [], []

        def first_layer(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.hidden.append(args[0] if args else kwargs.pop("hidden_states"))
            self.kwargs.append(kwargs)
            raise StopForward

        device = model.get_input_embeddings().weight.device
        handle = self.layers[0].register_forward_pre_hook(first_layer, with_kwargs=True)
        try:
            for chunk in chunks:
                try:
                    model(chunk[None].to(device), use_cache=False)
                except StopForward:
                    pass
        finally:
            handle.remove()

    def take_over(self, other: "Stream") -> None:
        """Continues from `other`'s stream as it is now (where the two models still agree)."""
        self.hidden = [h.to(self.hidden[k].device, self.dtype, copy=True) for k, h in enumerate(other.hidden)]

    def forward(self, layer: int, k: int) -> torch.Tensor | None:
        """Chunk `k`'s stream after decoder layer `layer`; None where a hook stopped the layer."""
        try:
            out = self.layers[layer](self.hidden[k], **self.kwargs[k])
        except StopForward:
            return None
        return out[0] if isinstance(out, tuple) else out

    def advance(self, layer: int, keep: nn.Module | None = None) -> list[torch.Tensor]:
        """Moves every chunk through decoder layer `layer`. Returns the input `keep` (a module of the layer) got, per
        chunk, without the batch dimension."""
        with capture_inputs([] if keep is None else [keep]) as got:
            kept = []
            for k in range(len(self.hidden)):
                self.hidden[k] = self.forward(layer, k)
                if keep is not None:
                    kept.append(got[keep][0][0])
        return kept


def train_gate(
    mlp: nn.Module,
    x: torch.Tensor,
    rows: torch.Tensor | None,
    targets: torch.Tensor,
    epochs: int,
    lr: float = 0.015,
    batch: int = 1024,
) -> bool:
    """Trains `mlp.gate_proj` (and `mlp.up_proj` when `rows` is None: a dense FFN), weights and biases, with Adam on
    minibatches of positions, `W_down` fixed, so that `W_down(SiLU(W_gate x) * rows)` (`W_up x` in place of `rows` for
    a dense FFN) comes closer to `targets` (`x`: `[positions, hidden]` FFN inputs; `rows`: `[positions, d_ff]`, in any
    dtype and on any device). The FFN's own linear modules and activation compute it, on fp32 copies of their weights.
    `lr` is relative to each weight's root mean square (Adam's steps do not scale with the gradient). The trained
    weights are kept only if they lower the loss over all the positions; returns whether they were."""
    check_epochs(epochs=epochs)
    trained = ("gate_proj",) if rows is not None else ("gate_proj", "up_proj")
    with torch.inference_mode(False), torch.enable_grad():
        x, y = x.float().clone(), targets.to(x.device, torch.float32).clone()  # normal tensors, not inference ones
        copies = {
            name: {key: p.detach().float().clone() for key, p in getattr(mlp, name).named_parameters()}
            for name in ("down_proj", *trained)
        }

        def linear(name: str, inputs: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(getattr(mlp, name), copies[name], (inputs,))

        def loss(b: torch.Tensor) -> torch.Tensor:
            up = linear("up_proj", x[b]) if rows is None else rows[b.to(rows.device)].to(x.device)
            return (linear("down_proj", mlp.act_fn(linear("gate_proj", x[b])) * up.float()) - y[b]).pow(2).sum()

        def total() -> float:
            with torch.no_grad():
                return sum(loss(b).item() for b in torch.arange(len(x), device=x.device).split(8 * batch))

        before = total()
        optimizer = torch.optim.Adam([_group(copies[name], lr) for name in trained])
        generator = torch.Generator().manual_seed(0)
        for _ in range(epochs):
            for b in torch.randperm(len(x), generator=generator).to(x.device).split(batch):
                optimizer.zero_grad()
                (loss(b) / len(b)).backward()
                optimizer.step()
        if not total() < before:  # also when training diverged to nan
            return False
        with torch.no_grad():
            for name in trained:
                for key, value in copies[name].items():
                    getattr(mlp, name).get_parameter(key).copy_(value)
        return True


def _group(linear: dict[str, torch.Tensor], lr: float) -> dict:
    """Adam's parameter group for a linear layer's weight and bias, at `lr` times the weight's root mean square."""
    scale = linear["weight"].pow(2).mean().sqrt().item()
    return {"params": [p.requires_grad_() for p in linear.values()], "lr": lr * scale}


def _refit_o_proj(layer: int, stem: Stream, after_attention: list[torch.Tensor], ridge: float) -> None:
    """Refits layer `layer`'s attention `o_proj` so that the converted residual after attention comes as close as it
    can to `after_attention` (the dense one, per chunk)."""
    o_proj = stem.layers[layer].self_attn.o_proj
    fit = RidgeFit(o_proj)
    with capture_inputs([o_proj], stop=o_proj) as got:
        for k, target in enumerate(after_attention):
            stem.forward(layer, k)
            hidden = stem.hidden[k][0]
            fit.add(got[o_proj][0][0], target.to(hidden) - hidden)
    fit.solve(ridge)


def _refit_down(layer: int, stem: Stream, dense: Stream, ridge: float, keep: bool) -> list[tuple]:
    """Refits layer `layer`'s FFN `W_down` so that the converted residual after the layer comes as close as it can to
    the dense one. With `keep`, returns per chunk the FFN's inputs (its input, and a STEM layer's rows) and target."""
    block = stem.layers[layer]
    down = block.mlp.down_proj
    fit, kept = RidgeFit(down), []
    with capture_inputs([block.post_attention_layernorm, block.mlp, down], stop=down) as got:
        for k in range(len(stem.hidden)):
            stem.forward(layer, k)
            residual = got[block.post_attention_layernorm][0][0]
            target = dense.hidden[k][0].to(residual) - residual
            fit.add(got[down][0][0], target)
            if keep:
                kept.append((tuple(a[0] for a in got[block.mlp]), target))
    fit.solve(ridge)
    return kept


def _train_locally(mlp: nn.Module, kept: list[tuple], epochs: int, ridge: float) -> bool:
    """Trains the FFN `mlp`'s gate (`train_gate`) on what `_refit_down` kept, then refits its `W_down` to the trained
    gate. Returns whether the training was kept."""
    lengths = [len(target) for _, target in kept]
    inputs = [torch.cat(column) for column in zip(*(args for args, _ in kept), strict=True)]
    targets = torch.cat([target for _, target in kept])
    kept.clear()  # the concatenations stand in for them
    if not train_gate(mlp, inputs[0], inputs[1] if len(inputs) > 1 else None, targets, epochs):
        return False
    fit = RidgeFit(mlp.down_proj)
    with capture_inputs([mlp.down_proj], stop=mlp.down_proj) as got:
        for *args, target in zip(*(tensor.split(lengths) for tensor in (*inputs, targets)), strict=True):
            try:
                mlp(*args)
            except StopForward:
                pass
            fit.add(got[mlp.down_proj][0], target)
    fit.solve(ridge)
    return True


@torch.inference_mode()
def refit(
    dense: nn.Module,
    stem: nn.Module,
    chunks: list[torch.Tensor],
    mode: str = "all",
    ridge: float = 1e-2,
    gate_epochs: int = 0,
    dense_epochs: int = 0,
) -> list[int]:
    """Refits `stem`'s output projections in place (see the module docstring) on calibration `chunks` (1-D token id
    tensors, each run as one sequence) run through both models, where they are. `mode`: one of `REFIT_MODES`. `ridge`
    scales the pull toward the current weights (0: plain least squares). `gate_epochs` and `dense_epochs`: passes of
    local training over the calibration positions for the STEM layers' gates and (with `"all"`) the dense layers' gates
    and up-projections; 0 trains nothing. Returns the layers whose local training was kept (it lowered their loss)."""
    if mode not in REFIT_MODES:
        raise ValueError(f"refit mode: {mode!r} is not one of {', '.join(REFIT_MODES)}")
    check_epochs(gate_epochs=gate_epochs, dense_epochs=dense_epochs)
    if ridge < 0:
        raise ValueError(f"ridge: {ridge} is negative")
    stem_layers, trained = set(stem.config.stem_layers), []
    if not stem_layers or not chunks:
        return trained
    first = min(stem_layers)
    last = len(stem.model.layers) - 1 if mode == "all" else max(stem_layers)
    dense_stream, stem_stream = Stream(dense, chunks), Stream(stem, chunks)
    for layer in tqdm(range(last + 1), desc=f"refit {mode}", unit="layer"):
        if layer == first or (mode == "plain" and layer in stem_layers):
            stem_stream.take_over(dense_stream)
        refits_dense = mode == "all" and layer > first  # at the first STEM layer the streams agree before attention
        norm = dense.model.layers[layer].post_attention_layernorm if refits_dense else None
        after_attention = dense_stream.advance(layer, keep=norm)
        if layer < first:
            continue
        if refits_dense:
            _refit_o_proj(layer, stem_stream, after_attention, ridge)
        del after_attention
        if layer in stem_layers or refits_dense:
            epochs = gate_epochs if layer in stem_layers else dense_epochs
            kept = _refit_down(layer, stem_stream, dense_stream, ridge, keep=epochs > 0)
            if kept and _train_locally(stem.model.layers[layer].mlp, kept, epochs, ridge):
                trained.append(layer)
            del kept
        if mode != "plain":
            stem_stream.advance(layer)
    return trained
