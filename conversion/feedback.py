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

Each solve sees the inputs its layer will see at inference: the layers before it are already refit. Memory, in the
models' dtype: the two streams plus, during one layer, its attention outputs and the dense stream after attention,
about `4 x calibration tokens x hidden` values (460 MB for SmolLM2 at 50k fp32 tokens; 3.3 GB for an 8B Llama), and
one fp64 `d_ff x (d_ff + hidden)` system at a time (21 MB; 2.1 GB). Both models are run where they are, on the
calibration chunks in full. Compute: about two forwards of each model over the calibration text, plus the Gram
matrices.
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


@torch.inference_mode()
def refit_feedback(
    dense: nn.Module, stem: nn.Module, chunks: list[torch.Tensor], ridge: float = 1e-2, correct_dense: bool = True
) -> None:
    """Refits `stem`'s output projections in place (see the module docstring) on calibration `chunks` (1-D token id
    tensors, each run as one sequence) run through both models. `ridge` scales the pull toward the current weights,
    relative to the mean diagonal of each Gram matrix."""
    if ridge < 0:
        raise ValueError(f"ridge: {ridge} is negative")
    stem_layers = set(stem.config.stem_layers)
    if not stem_layers or not chunks:
        return
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
        if layer in stem_layers or correct:
            fit = RidgeFit(stem_block.mlp.down_proj)
            for k, chunk in enumerate(chunks):
                h = _features(stem_block, hidden[k][0], None if table is None else table[chunk])
                fit.add(h, dense_stream.hidden[k][0].to(hidden[k]) - hidden[k][0])
            fit.solve(ridge)
        for k, chunk in enumerate(chunks):
            h = _features(stem_block, hidden[k], None if table is None else table[chunk][None])
            hidden[k] = hidden[k] + stem_block.mlp.down_proj(h)
