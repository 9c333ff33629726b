"""The models STEM is measured against in `benchmarks/paper_claims.py`, built from outside the shipped config.

- Ablations (the paper's "graveyard"): in every STEM layer the token table takes another place in the SwiGLU FFN.
  `up` is STEM itself; `gate`: `W_d(SiLU(U[t]) * W_u x)`; `added`: `W_d(SiLU(W_g x) * (W_u x + U[t]))`; `down`: the
  table replaces the down projection, `fold(SiLU(W_g x) * W_u x * U[t])`, where `fold` sums the slices of width `d`
  (the last one zero-padded; no parameters: a per-token diagonal down projection). Each is a `StemForCausalLM` whose
  STEM layers' FFN modules are swapped for the variant's; the tables, the row gathering and the training code are the
  model's own.
- The MoE baseline: transformers' own `MixtralForCausalLM`, top-k routing with its load-balancing loss, every FFN a
  mixture of experts whose top-k widths add up to the dense FFN's width.

Every variant's FFN width is chosen so that its active parameters per token (the paper's convention: embeddings and
head included, one table row per STEM layer, top-k experts plus the router for the MoE) match the dense model's.
"""

from dataclasses import replace

import torch
from torch import nn
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.activations import ACT2FN

from ..accounting import num_active_parameters
from ..configuration_stem import StemConfig
from ..modeling_stem import StemForCausalLM

ABLATIONS = ("up", "gate", "added", "down")  # where the table sits; `up` is STEM


class StemGateTableMLP(nn.Module):
    """The table in place of the gate: `down_proj(SiLU(rows) * up_proj(x))`."""

    def __init__(self, config: StemConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(rows.to(x.dtype)) * self.up_proj(x))


class StemAddedTableMLP(nn.Module):
    """The table added to the up projection: `down_proj(SiLU(gate_proj(x)) * (up_proj(x) + rows))`."""

    def __init__(self, config: StemConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * (self.up_proj(x) + rows.to(x.dtype)))


class StemDownTableMLP(nn.Module):
    """The table in place of the down projection: the SwiGLU activations times the token's row, folded back to the
    hidden size by summing slices of `hidden_size` (the last one zero-padded)."""

    def __init__(self, config: StemConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]
        self.hidden_size = config.hidden_size

    def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        h = self.act_fn(self.gate_proj(x)) * self.up_proj(x) * rows.to(x.dtype)
        h = nn.functional.pad(h, (0, -h.shape[-1] % self.hidden_size))
        return h.unflatten(-1, (-1, self.hidden_size)).sum(-2)


VARIANT_MLPS = {"gate": StemGateTableMLP, "added": StemAddedTableMLP, "down": StemDownTableMLP}


def build_variant(config: StemConfig, where: str) -> StemForCausalLM:
    """A `StemForCausalLM` of `config` whose STEM layers' FFNs put the table at `where` (one of `ABLATIONS`), freshly
    initialized the model's way (the tables with the model's own init)."""
    if where not in ABLATIONS:
        raise ValueError(f"ablation: unknown place {where!r}; one of {', '.join(ABLATIONS)}")
    model = StemForCausalLM(config)
    if where != "up":
        for idx in config.stem_layers:
            layer = model.model.layers[idx]
            layer.mlp = VARIANT_MLPS[where](config)
            layer.mlp.apply(model._init_weights)
    return model


def active_parameters(model: nn.Module) -> int:
    """Active parameters per token of a STEM model, an ablation variant, or a Mixtral MoE (all but the experts a token
    is not routed to)."""
    if isinstance(model, MixtralForCausalLM):
        config = model.config
        idle = config.num_local_experts - config.num_experts_per_tok
        experts = sum(p.numel() for layer in model.model.layers for p in layer.mlp.experts.parameters())
        return model.num_parameters() - experts * idle // config.num_local_experts
    return num_active_parameters(model)


def _meta_active(config: StemConfig, where: str) -> int:
    with torch.device("meta"):
        return active_parameters(build_variant(config, where))


def variant_config(stem: StemConfig, dense: StemConfig, where: str) -> StemConfig:
    """`stem` with the FFN width (a multiple of 8) that brings the variant's active parameters per token closest to
    `dense`'s."""
    target = _meta_active(dense, "up")
    sizes = range(8, 4 * dense.intermediate_size + 1, 8)
    best = min(sizes, key=lambda size: abs(_meta_active(replace(stem, intermediate_size=size), where) - target))
    return replace(stem, intermediate_size=best)


def moe_config(dense: StemConfig, experts: int = 8, top_k: int = 2, aux_loss_coef: float = 0.01) -> MixtralConfig:
    """A Mixtral config of `dense`'s shape: `experts` experts per layer, each `intermediate_size / top_k` wide, so a
    token's `top_k` experts hold as many FFN weights as the dense FFN; the router's load-balancing loss at
    `aux_loss_coef` (Switch Transformer's 0.01; transformers' Mixtral config defaults to 0.001)."""
    if dense.intermediate_size % top_k:
        raise ValueError(f"moe: intermediate_size {dense.intermediate_size} is not divisible by top_k {top_k}")
    return MixtralConfig(
        vocab_size=dense.vocab_size,
        hidden_size=dense.hidden_size,
        intermediate_size=dense.intermediate_size // top_k,
        num_hidden_layers=dense.num_hidden_layers,
        num_attention_heads=dense.num_attention_heads,
        num_key_value_heads=dense.num_key_value_heads,
        max_position_embeddings=dense.max_position_embeddings,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        output_router_logits=True,  # adds the load-balancing loss to the training loss
        router_aux_loss_coef=aux_loss_coef,
        tie_word_embeddings=dense.tie_word_embeddings,
        rms_norm_eps=dense.rms_norm_eps,
        initializer_range=dense.initializer_range,
        rope_parameters=dict(dense.rope_parameters),
        pad_token_id=dense.pad_token_id,
        bos_token_id=dense.bos_token_id,
        eos_token_id=dense.eos_token_id,
    )


__all__ = [
    "ABLATIONS",
    "StemAddedTableMLP",
    "StemDownTableMLP",
    "StemGateTableMLP",
    "active_parameters",
    "build_variant",
    "moe_config",
    "variant_config",
]
