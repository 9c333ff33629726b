"""The models STEM is measured against in `benchmarks/paper_claims.py`, built from outside the shipped config.

- Ablations (the paper's "graveyard"): in every STEM layer the token table takes another place in the SwiGLU FFN.
  `up` is STEM itself; `gate`: `W_d(SiLU(U[t]) * W_u x)`; `added`: `W_d(SiLU(W_g x) * (W_u x + U[t]))`; `down`: the
  table replaces the down projection, `fold(SiLU(W_g x) * W_u x * U[t])`, where `fold` sums the slices of width `d`
  (the last one zero-padded; no parameters: a per-token diagonal down projection). Each is a `StemForCausalLM` whose
  STEM layers' FFN modules are swapped for the variant's; the tables, the row gathering and the training code are the
  model's own.
- The MoE baseline: transformers' own `MixtralForCausalLM`, top-k routing with its load-balancing loss, every FFN a
  mixture of experts whose top-k widths add up to the dense FFN's width.
- The paper's MoE baseline, hash-routed and fine-grained (`build_hash_moe`): every FFN `num_experts` small SwiGLU
  experts, a token's `top_k` of them fixed by a hash of its id (no router, no balancing loss), their outputs summed;
  `top_k` experts of width `intermediate_size / top_k` hold as many weights as the dense FFN. The model is a
  `StemForCausalLM` whose every layer reads per-token data by id: the routes come through the model's row-source
  interface (`set_row_source`) and its tables are empty, as `StemOffloadEngine(free_tables=True)` leaves them.

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


def hash_routes(vocab_size: int, num_experts: int, top_k: int, seed: int) -> torch.Tensor:
    """`[vocab_size, top_k]` expert indices, fixed by `seed`: the experts form `top_k` groups, and slot j of a token
    is the expert of group j that a random hash of its id picks (a seeded permutation of the vocabulary, modulo the
    group's size). A token's experts are distinct, and each expert is picked by as many vocabulary ids as any other
    in its slot, within one: balanced over the vocabulary by construction (over text, token frequency decides)."""
    if top_k < 1 or num_experts % top_k:
        raise ValueError(f"hash MoE: {num_experts} experts do not split into top_k={top_k} equal groups")
    group = num_experts // top_k
    generator = torch.Generator().manual_seed(seed)
    slots = [j * group + torch.randperm(vocab_size, generator=generator) % group for j in range(top_k)]
    return torch.stack(slots, dim=1)


class StemHashMoEMLP(nn.Module):
    """A hash-routed fine-grained MoE FFN: `num_experts` SwiGLU experts of width `intermediate_size // top_k`, stored
    side by side (expert e is units `e * width` to `(e + 1) * width` of each projection); each token runs the `top_k`
    experts `routes[token_id]` names, and their outputs add up. `routes` is a buffer, fixed. The lab computes every
    expert and masks the others' units to zero (a few large products are faster here than a loop over experts); the
    FLOPs counted are the `top_k` experts'."""

    def __init__(self, config: StemConfig, num_experts: int, top_k: int, routes: torch.Tensor):
        super().__init__()
        if config.intermediate_size % top_k or config.mlp_bias:
            raise ValueError(f"hash MoE: intermediate_size not divisible by {top_k}, or mlp_bias (not supported)")
        self.num_experts, self.top_k, self.width = num_experts, top_k, config.intermediate_size // top_k
        units = num_experts * self.width
        self.gate_proj = nn.Linear(config.hidden_size, units, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, units, bias=False)
        self.down_proj = nn.Linear(units, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]
        self.register_buffer("routes", routes, persistent=True)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        chosen = torch.zeros(*token_ids.shape, self.num_experts, dtype=x.dtype, device=x.device)
        chosen.scatter_(-1, self.routes[token_ids], 1.0)
        mask = chosen.repeat_interleave(self.width, dim=-1)
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * mask)


class StemTokenIds:
    """A row source (`StemModel.set_row_source`) that gives every layer the token ids themselves: what a hash-routed
    FFN reads in place of table rows."""

    def __call__(self, stem_input_ids: torch.LongTensor) -> "StemTokenIds._Ids":
        return StemTokenIds._Ids(stem_input_ids)

    class _Ids:
        def __init__(self, ids: torch.LongTensor):
            self.ids = ids

        def __getitem__(self, layer_idx: int) -> torch.LongTensor:
            return self.ids


def build_hash_moe(dense: StemConfig, num_experts: int = 16, top_k: int = 4, seed: int = 0) -> StemForCausalLM:
    """The paper's kind of MoE baseline at `dense`'s shape and active parameters: every layer's FFN a
    `StemHashMoEMLP` (routes hashed per layer from `seed`), freshly initialized the model's way."""
    config = replace(dense, stem_layers=list(range(dense.num_hidden_layers)))
    model = StemForCausalLM(config)
    for idx, layer in enumerate(model.model.layers):
        routes = hash_routes(config.vocab_size, num_experts, top_k, seed=seed * 1_000 + idx)
        layer.mlp = StemHashMoEMLP(config, num_experts, top_k, routes)
        layer.mlp.apply(model._init_weights)
    for table in model.model.stem_tables.values():  # routes, not rows: no table is read
        table.weight = nn.Parameter(torch.empty(0, config.intermediate_size), requires_grad=False)
    model.model.set_row_source(StemTokenIds())
    return model


def is_hash_moe(model: nn.Module) -> bool:
    return isinstance(model, StemForCausalLM) and all(
        isinstance(layer.mlp, StemHashMoEMLP) for layer in model.model.layers
    )


def load_summary(counts: torch.Tensor) -> dict:
    """From `[layers, experts]` counts of routed token slots: each expert's share per layer; `max_over_mean` the
    busiest expert's share times the number of experts (1.0 is a perfect balance), `idle_experts` those under a tenth
    of the mean."""
    shares = counts / counts.sum(-1, keepdim=True)
    mean = 1 / counts.shape[1]
    return {
        "shares": shares.tolist(),
        "max_over_mean": (shares.max(-1).values / mean).tolist(),
        "idle_experts": (shares < 0.1 * mean).sum(-1).tolist(),
    }


def hash_expert_load(model: StemForCausalLM, blocks: torch.Tensor) -> dict:
    """`load_summary` of the hash MoE's routes over the tokens of `blocks`, as `claims.expert_load` for Mixtral."""
    ids = blocks.flatten()
    counts = [
        torch.bincount(layer.mlp.routes.cpu()[ids].flatten(), minlength=layer.mlp.num_experts).float()
        for layer in model.model.layers
    ]
    return load_summary(torch.stack(counts))


def active_parameters(model: nn.Module) -> int:
    """Active parameters per token of a STEM model, an ablation variant, a Mixtral MoE (all but the experts a token
    is not routed to), or the hash MoE (likewise)."""
    if is_hash_moe(model):
        mlps = [layer.mlp for layer in model.model.layers]
        experts = sum(p.numel() for mlp in mlps for p in mlp.parameters())
        return model.num_parameters() - experts * (mlps[0].num_experts - mlps[0].top_k) // mlps[0].num_experts
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
    "StemHashMoEMLP",
    "StemTokenIds",
    "active_parameters",
    "build_hash_moe",
    "build_variant",
    "hash_expert_load",
    "hash_routes",
    "is_hash_moe",
    "load_summary",
    "moe_config",
    "variant_config",
]
