"""Sequential error-feedback refit: the converted model's output projections refit, layer by layer, to bring its
residual stream back to the dense model's.

A token-indexed row cannot follow the context the way `W_up x` does, so each STEM layer leaves an error in the residual
stream, and the layers after it see drifted inputs. Both models' residual streams over the calibration text are held in
memory and advanced one layer at a time; at each layer, before advancing, the output projections are refit in closed
form (ridge least squares, shrunk toward their current weights) so that the converted stream after each sublayer comes
as close as a linear map can to the dense stream:

- a STEM layer's `W_down`, with the rows fixed: `y = W_down h`, `h = SiLU(W_gate x) * U[t]`, target the dense residual
  after the layer minus the converted residual before the FFN;
- with `correct_dense`, after the first STEM layer also every attention `o_proj` (target: the dense residual after
  attention minus the converted residual before it) and every dense layer's `W_down`. These layers compute
  context-dependent features the tables lack, and spend a little of their capacity on undoing the drift.
- with `gate_epochs`, each STEM layer's gate is then trained locally (Adam on minibatches of positions, `W_down` held)
  toward the same target, and `W_down` refit once more to the trained gate: the gate is the only part of a STEM FFN
  that sees the context, so it can learn some of what the row cannot. `dense_epochs` does the same for the gate and
  up-projection of every dense layer that `correct_dense` refits.

Each solve sees the inputs its layer will see at inference: the layers before it are already refit. Memory, in the
models' dtype: the two streams plus, during one layer, its attention outputs and the dense stream after attention,
about `4 x calibration tokens x hidden` values (460 MB for SmolLM2 at 50k fp32 tokens; 3.3 GB for an 8B Llama), and
one fp64 `d_ff x (d_ff + hidden)` system at a time (21 MB; 2.1 GB); local training adds the layer's FFN inputs and
targets (fp32, the targets twice) and its rows (in the table's dtype), `3 x hidden + d_ff` values per calibration token
(1.5 GB for SmolLM2 at 150k tokens). Both models are run where they are, on the calibration chunks in full. Compute:
about two forwards of each model over the calibration text, plus the Gram matrices, plus `epochs` passes of local
training per layer.
"""

import torch
from torch import nn
from tqdm import tqdm
from transformers.masking_utils import create_causal_mask


class _Stream:
    """One model's residual stream over every calibration chunk, advanced one decoder layer at a time."""

    def __init__(self, model: nn.Module, chunks: list[torch.Tensor], hidden: list[torch.Tensor] | None = None):
        self.model = model
        inner = model.model
        weight = inner.embed_tokens.weight
        device = weight.device
        if hidden is None:
            self.hidden = [inner.embed_tokens(c[None].to(device)) for c in chunks]
        else:  # another model's stream, taken over where the two still agree
            self.hidden = [h.to(device, weight.dtype, copy=True) for h in hidden]
        self.positions = [torch.arange(len(c), device=device)[None] for c in chunks]
        self.rotary = [inner.rotary_emb(h, p) for h, p in zip(self.hidden, self.positions, strict=True)]
        self.masks = [
            create_causal_mask(
                config=model.config, inputs_embeds=h, attention_mask=None, past_key_values=None, position_ids=p
            )
            for h, p in zip(self.hidden, self.positions, strict=True)
        ]

    def attend(self, layer: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(o_proj input, residual after attention)` of chunk `k` at `layer`."""
        block, got = self.model.model.layers[layer], []
        handle = block.self_attn.o_proj.register_forward_pre_hook(lambda _m, args: got.append(args[0]))
        try:
            out, _ = block.self_attn(
                hidden_states=block.input_layernorm(self.hidden[k]),
                attention_mask=self.masks[k],
                position_ids=self.positions[k],
                position_embeddings=self.rotary[k],
            )
        finally:
            handle.remove()
        return got[0][0], (self.hidden[k] + out)[0]


def _features(block: nn.Module, residual: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """What the FFN's `down_proj` multiplies, from the residual after attention: `SiLU(W_g x) * U[t]` (STEM) or
    `SiLU(W_g x) * W_up x` (dense), `x` the normed residual. Recomputed when needed rather than kept: `[tokens, d_ff]`
    per chunk is the largest tensor of the pass."""
    mlp, x = block.mlp, block.post_attention_layernorm(residual)
    return mlp.act_fn(mlp.gate_proj(x)) * (mlp.up_proj(x) if rows is None else rows.to(x.device, x.dtype))


def _refit_down(block: nn.Module, hidden: list, table, chunks: list, targets: list, ridge: float) -> None:
    """Refits `block`'s FFN `W_down` so that the FFN output on each of `hidden` (residuals after attention) comes as
    close as it can to `targets`."""
    fit = RidgeFit(block.mlp.down_proj)
    for k, chunk in enumerate(chunks):
        fit.add(_features(block, hidden[k][0], None if table is None else table[chunk]), targets[k])
    fit.solve(ridge)


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
        weight = self.linear.weight
        lam = ridge * self.gram.diagonal().mean()
        self.gram.diagonal().add_(lam)  # in place: at 8B scale the Gram matrix alone is 1.6 GB
        solution = torch.linalg.solve(self.gram, self.cross + lam * weight.T.double().cpu())
        weight.copy_(solution.T.to(weight.device, weight.dtype))


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
    minibatches of positions, `W_down` fixed, so that `W_down(SiLU(W_gate x) * rows)` comes closer to `targets`
    (`x`: `[positions, hidden]` FFN inputs; `rows`: `[positions, d_ff]`, in any dtype and on any device). `lr` is
    relative to each weight's root mean square (Adam's steps do not scale with the gradient): 3e-3 for SmolLM2's. The
    trained weights are kept only if they lower the loss over all the positions; returns whether they were."""
    _check_epochs(epochs=epochs)
    with torch.inference_mode(False), torch.enable_grad():
        x, y = x.float().clone(), targets.to(x.device, torch.float32).clone()  # normal tensors, not inference ones
        linears = [mlp.gate_proj] + ([mlp.up_proj] if rows is None else [])
        copies = [[p.detach().clone().float() if p is not None else None for p in (m.weight, m.bias)] for m in linears]
        down = [p.detach().float() if p is not None else None for p in (mlp.down_proj.weight, mlp.down_proj.bias)]

        def loss(b: torch.Tensor) -> torch.Tensor:
            gate = mlp.act_fn(nn.functional.linear(x[b], *copies[0]))
            up = nn.functional.linear(x[b], *copies[1]) if rows is None else rows[b.to(rows.device)].to(x.device)
            return (nn.functional.linear(gate * up.float(), *down) - y[b]).pow(2).sum()

        def total() -> float:
            with torch.no_grad():
                return sum(loss(b).item() for b in torch.arange(len(x), device=x.device).split(8 * batch))

        before = total()
        groups = [
            {"params": [p.requires_grad_() for p in c if p is not None], "lr": lr * c[0].pow(2).mean().sqrt().item()}
            for c in copies
        ]
        optimizer = torch.optim.Adam(groups)
        generator = torch.Generator().manual_seed(0)
        for _ in range(epochs):
            for b in torch.randperm(len(x), generator=generator).to(x.device).split(batch):
                optimizer.zero_grad()
                (loss(b) / len(b)).backward()
                optimizer.step()
        if not total() < before:  # also when training diverged to nan
            return False
        with torch.no_grad():
            for module, (weight, bias) in zip(linears, copies, strict=True):
                module.weight.copy_(weight)
                if bias is not None:
                    module.bias.copy_(bias)
        return True


def _check_epochs(**epochs) -> None:
    for name, value in epochs.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: {value!r} is not a whole number of epochs")


@torch.inference_mode()
def refit_feedback(
    dense: nn.Module,
    stem: nn.Module,
    chunks: list[torch.Tensor],
    ridge: float = 1e-2,
    correct_dense: bool = True,
    gate_epochs: int = 0,
    dense_epochs: int = 0,
) -> list[int]:
    """Refits `stem`'s output projections in place (see the module docstring) on calibration `chunks` (1-D token id
    tensors, each run as one sequence) run through both models. `ridge` scales the pull toward the current weights,
    relative to the mean diagonal of each Gram matrix. `gate_epochs` and `dense_epochs`: passes of local training over
    the calibration positions for the STEM layers' gates and (with `correct_dense`) the dense layers' gates and
    up-projections; 0 trains nothing. Returns the layers whose local training was kept (it lowered their loss)."""
    _check_epochs(gate_epochs=gate_epochs, dense_epochs=dense_epochs)
    if ridge < 0:
        raise ValueError(f"ridge: {ridge} is negative")
    stem_layers, trained = set(stem.config.stem_layers), []
    if not stem_layers or not chunks:
        return trained
    first = min(stem_layers)
    last = stem.config.num_hidden_layers - 1 if correct_dense else max(stem_layers)
    dense_stream, stem_stream = _Stream(dense, chunks), None  # the two agree up to the first STEM layer
    tables = stem.model.stem_tables
    for layer in tqdm(range(last + 1), desc="refitting along the residual stream", unit="layer"):
        dense_block, stem_block = dense.model.layers[layer], stem.model.layers[layer]
        if layer == first:
            stem_stream = _Stream(stem, chunks, hidden=dense_stream.hidden)
        correct = correct_dense and layer > first  # o_proj and dense W_down; at the first STEM layer the streams agree
        dense_after_attention = []
        for k in range(len(chunks)):
            _, residual = dense_stream.attend(layer, k)
            if correct:
                dense_after_attention.append(residual)
            dense_stream.hidden[k] = (residual + dense_block.mlp(dense_block.post_attention_layernorm(residual)))[None]
        if stem_stream is None:
            continue
        hidden = stem_stream.hidden
        o_proj = stem_block.self_attn.o_proj
        heads = [stem_stream.attend(layer, k)[0] for k in range(len(chunks))]
        if correct:
            fit = RidgeFit(o_proj)
            for k, target in enumerate(dense_after_attention):
                fit.add(heads[k], target.to(hidden[k]) - hidden[k][0])
            fit.solve(ridge)
        del dense_after_attention
        for k in range(len(chunks)):
            hidden[k] = hidden[k] + o_proj(heads[k])  # the residual after attention, what the FFN output is added to
        del heads

        table = tables[str(layer)].weight if layer in stem_layers else None
        if table is not None or correct:
            # One tensor over all positions (the training reads it whole), refit chunk by chunk through views of it.
            targets = torch.cat([dense_stream.hidden[k][0].to(hidden[k]) - hidden[k][0] for k in range(len(chunks))])
            per_chunk = targets.split([len(chunk) for chunk in chunks])
            _refit_down(stem_block, hidden, table, chunks, per_chunk, ridge)
            epochs = gate_epochs if table is not None else dense_epochs
            if epochs:  # from the refit W_down, which is then refit again to the trained features
                # Passed without a name here: train_gate's own copies replace them (inference tensors cannot train).
                if train_gate(
                    stem_block.mlp,
                    torch.cat([stem_block.post_attention_layernorm(h[0]) for h in hidden]),
                    None if table is None else table[torch.cat(chunks).to(table.device)],
                    targets,
                    epochs,
                ):
                    _refit_down(stem_block, hidden, table, chunks, per_chunk, ridge)
                    trained.append(layer)
            del targets, per_chunk
        for k, chunk in enumerate(chunks):
            h = _features(stem_block, hidden[k], None if table is None else table[chunk][None])
            hidden[k] = hidden[k] + stem_block.mlp.down_proj(h)
    return trained
