"""STEM: Scaling Transformers with Embedding Modules (arXiv 2601.10639) as a transformers causal LM.

A Llama-family decoder in which the FFN of each layer listed in `config.stem_layers` computes
`down_proj(SiLU(gate_proj(x)) * U_l[t])`: the up-projection is replaced by a row of a per-layer table `U_l` indexed by
the input token id `t`. Every other weight keeps `LlamaForCausalLM`'s name, so a Llama state dict loads as is when
`stem_layers` is empty.

Copied next to the weights by `save_pretrained`: imports nothing beyond torch and transformers.
"""

import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.integrations.accelerate import _get_device_map, check_and_set_device_map
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_stem import StemConfig, check_table_dtype, resolve_stem_layers
from .storage_stem import (
    PROVENANCE_FILES,
    SAVE_ID_KEY,
    TABLE_KEY,
    advise_random_access,
    check_checkpoint_files,
    check_variant,
    finish_checkpoint,
    read_save_id,
    staged_folder,
    stale_provenance,
    unsaved_id,
)

logger = logging.get_logger(__name__)

# What `from_pretrained` passes on to read a config from the Hub.
_CONFIG_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")
# Config fields that give the saved tensors their shapes: a load cannot change them.
_FIXED_AT_SAVE = ("stem_layers", "vocab_size", "intermediate_size", "hidden_size", "num_hidden_layers")


def _refuse_shape_overrides(config: StemConfig, kwargs: dict) -> None:
    """Raises if `from_pretrained(..., stem_layers=...)` (or another shape field) asks for other tensors than the
    checkpoint holds: the override would otherwise reach the weights as a missing or unexpected table."""
    for name in _FIXED_AT_SAVE:
        if name not in kwargs:
            continue
        wanted = kwargs[name]
        if name == "stem_layers":
            wanted = resolve_stem_layers(wanted, config.num_hidden_layers)
        if wanted != getattr(config, name):
            hint = " (convert the dense model again with the layers you want)" if name == "stem_layers" else ""
            raise ValueError(
                f"{name}={kwargs[name]!r}: the checkpoint was saved with {name}={getattr(config, name)!r}, and a load "
                f"cannot change which tensors it holds{hint}"
            )
        del kwargs[name]


class StemRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class StemRotaryEmbedding(nn.Module):
    def __init__(self, config: StemConfig):
        super().__init__()
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.config = config
        self.rope_type = config.rope_parameters["rope_type"]
        rope_init_fn: Callable = self.compute_default_rope_parameters
        if self.rope_type != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(config)
        # Non-persistent: `PreTrainedModel._init_weights` recomputes both after a meta-device load.
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: StemConfig, **kwargs) -> tuple[torch.Tensor, float]:
        base = config.rope_parameters["rope_theta"]
        dim = config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Unpack[TransformersKwargs],
):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


class StemAttention(nn.Module):
    """Grouped-query attention with RoPE; optional per-head q/k RMSNorm (Qwen3) and q/k/v bias (Qwen2)."""

    def __init__(self, config: StemConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True

        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_out_bias
        )
        if config.qk_norm:
            self.q_norm = StemRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = StemRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        if self.config.qk_norm:
            query_states = self.q_norm(query_states)
            key_states = self.k_norm(key_states)
        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class StemMLP(nn.Module):
    """The dense SwiGLU FFN of the layers not listed in `stem_layers`."""

    def __init__(self, config: StemConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class StemTableMLP(nn.Module):
    """A STEM FFN: `down_proj(SiLU(gate_proj(x)) * rows)`, `rows` being this layer's table rows for the input tokens.

    It owns no table: the model's `StemTables` does, so an offload engine can fetch every STEM layer's rows for a batch
    in one pass. This module only consumes rows.
    """

    def __init__(self, config: StemConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        # Cast the gathered rows, never the table: tables may be stored in another dtype or live on another device.
        rows = rows.to(device=x.device, dtype=x.dtype)
        return self.down_proj(self.act_fn(self.gate_proj(x)) * rows)


class StemTable(nn.Embedding):
    """One STEM layer's `[vocab_size, intermediate_size]` table. Its own class so that `_init_weights` can tell it from
    the token embedding and give it the paper's xavier-normal init."""


class StemTableRows:
    """The table rows of one batch, handed out per STEM layer.

    This default gathers each layer's rows when that layer asks, inside the layer's (possibly checkpointed) forward, so
    activation checkpointing recomputes rows instead of keeping them. A table in host memory serving a model on an
    accelerator is read on the host for the batch's distinct ids only, and only those rows cross to the accelerator.
    An offload engine returns an object with the same `__getitem__` that serves rows it gathered for all layers at once.
    """

    def __init__(self, tables: "StemTables", stem_input_ids: torch.LongTensor):
        self.tables = tables
        self.stem_input_ids = stem_input_ids
        self._unique = None

    def __getitem__(self, layer_idx: int) -> torch.Tensor:
        table = self.tables[str(layer_idx)]
        ids = self.stem_input_ids
        table_device = table.weight.device
        if table_device == ids.device or table_device.type == "meta":  # meta: an accelerate hook brings the weight
            return table(ids)
        return self.gather_unique(table, ids)

    def gather_unique(self, table: nn.Embedding, ids: torch.LongTensor) -> torch.Tensor:
        """Rows for `ids` from a table on another device: looks up each distinct id once on the table's device and
        moves only those rows to the device of `ids`. Differentiable, so host-resident tables also train."""
        if self._unique is None:  # deduplicate once per forward, for every layer
            unique, inverse = torch.unique(ids.to(table.weight.device), return_inverse=True)
            self._unique = unique, inverse.to(ids.device, non_blocking=True)
        unique, inverse = self._unique
        return table(unique).to(ids.device, non_blocking=True)[inverse]


class StemSoftPromptRows:
    """Rows for inputs whose first `num_soft` positions are soft prompts (embeddings with no token, as PEFT prompt
    tuning prepends): those positions get a zero row, so a STEM layer's FFN adds nothing there."""

    def __init__(self, rows, num_soft: int):
        self.rows = rows
        self.num_soft = num_soft

    def __getitem__(self, layer_idx: int) -> torch.Tensor:
        return nn.functional.pad(self.rows[layer_idx], (0, 0, self.num_soft, 0))


_OPTIMIZER_HOOK = None  # the handle of `_check_optimizer`, registered at most once per process


def _check_optimizer(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook (process-wide, added once a table trains). Casts a table's optimizer state to the
    table's dtype: a resumed `Trainer` loads the state before `train()` upcasts the tables, so torch cast it to bf16.
    Warns once per optimizer that decays a table: a plain `Trainer` decays every matrix but norms and biases, and
    decoupled decay shrinks every row at each step, its token in the batch or not; no model-side setting reaches
    Trainer's groups."""
    tables = getattr(optimizer, "_stem_tables", None)
    if tables is None:
        tables = optimizer._stem_tables = [
            (group, p) for group in optimizer.param_groups for p in group["params"] if getattr(p, "_stem_table", False)
        ]
        decayed = next((group for group, _ in tables if group.get("weight_decay")), None)
        if decayed is not None:
            logger.warning(
                f"{type(optimizer).__name__} applies weight_decay={decayed['weight_decay']} to STEM tables: every row "
                "shrinks at each step, its token in the batch or not. Put the tables in a group with weight_decay=0 "
                "(stem_hf.training.param_groups), or train with stem_hf.training.StemTrainer, which does"
            )
    for _, param in tables:
        if param.dtype != torch.float32:
            continue  # only an upcast table needs its state raised; optimizers may keep fp32 state on purpose
        state = optimizer.state.get(param, {})
        for key, value in state.items():
            if torch.is_tensor(value) and value.dtype in (torch.bfloat16, torch.float16) and value.shape == param.shape:
                state[key] = value.float()


class StemTables(nn.ModuleDict):
    """Every STEM layer's table, keyed by layer index: weights are named `model.stem_tables.{layer_idx}.weight`.

    Tables keep `config.table_dtype` through model-wide casts, and stay in host memory when the model moves to an
    accelerator if `config.keep_tables_on_cpu`: a model-wide `.to()` must not copy billions of table parameters.

    Trainable tables train in float32: `train()` casts them (`upcast_trainable`; set `upcast_for_training` to False to
    keep them as stored) and sets `config.table_dtype` to float32, so that saves keep every update. A bf16 value moves
    only by steps of 1/256 of its size: fine-tuning updates would round away in training and again at save time.
    """

    upcast_for_training: bool = True

    def __init__(self, config: StemConfig):
        dtype = getattr(torch, config.table_dtype)
        super().__init__(
            {str(i): StemTable(config.vocab_size, config.intermediate_size, dtype=dtype) for i in config.stem_layers}
        )
        self.config = config

    def forward(self, stem_input_ids: torch.LongTensor) -> StemTableRows:
        if self.training and torch.is_grad_enabled():
            low = {
                str(t.weight.dtype)[6:]
                for t in self.values()
                if t.weight.requires_grad and t.weight.dtype != torch.float32
            }
            if low:
                logger.warning_once(
                    f"training STEM tables in {', '.join(sorted(low))}: updates smaller than 1/256 of a value are lost "
                    "to rounding. Call model.base_model.stem_tables.upcast_trainable() before wrapping the model for "
                    "DDP/FSDP (train() does it when torch.distributed is not initialized) to train them in float32"
                )
        return StemTableRows(self, stem_input_ids)

    def train(self, mode: bool = True) -> "StemTables":
        super().train(mode)
        if mode:
            trainable = [t.weight for t in self.values() if t.weight.requires_grad]
            for weight in trainable:
                weight._stem_table = True  # lets `_check_optimizer` tell tables from other matrices
            global _OPTIMIZER_HOOK
            if trainable and _OPTIMIZER_HOOK is None:
                _OPTIMIZER_HOOK = register_optimizer_step_pre_hook(_check_optimizer)
            # A model wrapped for DDP/FSDP cannot change a parameter's dtype: there, upcast_trainable() is the
            # caller's, before wrapping, and the forward warns.
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
            if self.upcast_for_training and not distributed:
                self.upcast_trainable()
        return self

    def upcast_trainable(self) -> list[str]:
        """Casts the tables that require grad to float32 in memory (a memory-mapped table's file is left as it is),
        records float32 in `config.table_dtype` (what saves write: `model.set_table_dtype("bfloat16")` stores bf16
        again), and returns their layer keys. Sharded (DTensor) tables are left as they are."""
        keys = [
            k
            for k, t in self.items()
            if t.weight.requires_grad
            and t.weight.dtype != torch.float32
            and t.weight.device.type != "meta"
            and type(t.weight).__name__ != "DTensor"
        ]
        if not keys:
            return []
        stored = self.config.table_dtype
        for key in keys:
            self[key].to(torch.float32)  # the module's own cast: StemTables._apply would refuse it
        # Saves follow the config: float32 once every table is, so the updates are kept; with frozen tables still in
        # their stored dtype, the config stays and the save warns that it rounds the trained ones.
        if all(t.weight.dtype == torch.float32 for t in self.values()):
            self.config.table_dtype = "float32"
        logger.warning_once(
            f"STEM tables {keys} train in float32: cast from {stored} in memory "
            f"({sum(self[k].weight.numel() for k in keys) * 4 / 2**30:.2f} GiB); config.table_dtype is "
            f"{self.config.table_dtype} (model.set_table_dtype chooses what saves write). Freeze them "
            "(requires_grad_(False)) or set model.base_model.stem_tables.upcast_for_training = False to keep them as "
            "stored"
        )
        return keys

    def _apply(self, fn, recurse=True):
        weight = next(self.parameters(), None)
        if weight is None:
            return super()._apply(fn, recurse)
        # `fn` is opaque (`.to`, `.cuda`, `.half`, `to_empty`...): run it on an empty tensor to see where it sends data.
        probe = fn(torch.empty(0, dtype=weight.dtype, device=weight.device))
        device = probe.device
        if self.config.keep_tables_on_cpu and device.type != "cpu" and device != weight.device:
            device = torch.device("cpu")  # a refused move: stay in, or come to, host memory
        if probe.dtype == weight.dtype and device == probe.device:
            return super()._apply(fn, recurse)  # no cast and no refused move: e.g. share_memory_, a move to CPU
        if device == weight.device:
            return self
        if weight.device.type == "meta":  # nothing to copy: `to_empty` to an accelerator lands tables on the CPU
            return super()._apply(lambda t: torch.empty_like(t, device=device), recurse)
        return super()._apply(lambda t: t.to(device), recurse)

    @torch.no_grad()
    def resize(self, new_num_tokens: int, mean_resizing: bool = True) -> None:
        """Gives every table `new_num_tokens` rows. Kept rows are copied; new rows are the mean of the old rows
        (`mean_resizing=True`: the table's best guess for a token it knows nothing about) or drawn from the paper's
        xavier-normal init (`mean_resizing=False`)."""
        for key, old in list(self.items()):
            old_num_tokens, dim = old.weight.shape
            if old_num_tokens == new_num_tokens:
                continue
            new = StemTable(new_num_tokens, dim, device=old.weight.device, dtype=old.weight.dtype)
            kept = min(old_num_tokens, new_num_tokens)
            new.weight[:kept] = old.weight[:kept]
            if new_num_tokens > old_num_tokens:
                if mean_resizing:
                    new.weight[old_num_tokens:] = old.weight.mean(0, dtype=torch.float32).to(old.weight.dtype)
                else:
                    new.weight[old_num_tokens:].normal_(0.0, xavier_normal_std(new_num_tokens, dim))
            new.weight.requires_grad_(old.weight.requires_grad)
            self[key] = new


def xavier_normal_std(vocab_size: int, intermediate_size: int) -> float:
    return math.sqrt(2.0 / (vocab_size + intermediate_size))


class StemDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: StemConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_stem = layer_idx in config.stem_layers
        self.self_attn = StemAttention(config=config, layer_idx=layer_idx)
        self.mlp = StemTableMLP(config) if self.is_stem else StemMLP(config)
        self.input_layernorm = StemRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = StemRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        stem_rows: StemTableRows | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        if self.is_stem:
            hidden_states = self.mlp(hidden_states, stem_rows[self.layer_idx])
        else:
            hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


@torch.compiler.disable  # a graph break: under torch.compile the check still runs, before inductor's gather
def check_token_ids(ids: torch.Tensor, vocab_size: int, name: str) -> None:
    """Raises if `ids` holds an id outside `[0, vocab_size)`. On a GPU an out-of-range gather is a device-side assert
    that kills the process, so the check runs before any lookup (one host sync per forward)."""
    if ids.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(ids)).tolist()
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{name} holds token id {bad}, outside [0, {vocab_size}): vocab_size is {vocab_size}")


class StemPreTrainedModel(PreTrainedModel):
    config: StemConfig
    config_class = StemConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["StemDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_record_outputs = {
        "hidden_states": StemDecoderLayer,
        "attentions": StemAttention,
    }
    # Set by the stem_hf package (`stem_hf.model_card.write_model_card`): the card template and renderer ship with the
    # package, not with the code copied next to the weights, so a model loaded without stem_hf saves no card.
    _model_card_writer: Callable | None = None

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, StemTable):
            # The paper's init: xavier-normal over the [vocab, d_ff] table, tiny next to a normal up-projection output.
            init.normal_(module.weight, mean=0.0, std=xavier_normal_std(*module.weight.shape))
        else:
            super()._init_weights(module)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`PreTrainedModel.from_pretrained`, after checking a local checkpoint's files: a missing shard, a truncated or
        corrupt file, or a table whose shape disagrees with the config raises an error naming the file and tensor.

        On CPU, tables stored in `config.table_dtype` load as zero-copy views on a private memory map of their files:
        only the rows a forward touches are read, and writing to a table never alters its file.
        """
        path = pretrained_model_name_or_path
        save_id = None  # the checkpoint's, from check_checkpoint_files when it is a local folder
        folder = None if path is None else os.path.join(os.fspath(path), kwargs.get("subfolder", ""))
        device_map = kwargs.get("device_map")
        shape_override = any(name in kwargs for name in _FIXED_AT_SAVE)
        if path is not None and (os.path.isdir(folder) or device_map is not None or shape_override):
            config = kwargs.get("config")
            if getattr(config, "model_type", None) != StemConfig.model_type:
                # The config from_pretrained will build: the saved one with the caller's overrides applied.
                fields = {f.name for f in dataclasses.fields(StemConfig)} - set(_FIXED_AT_SAVE)
                overrides = {k: v for k, v in kwargs.items() if k in fields or k in _CONFIG_KWARGS}
                config = StemConfig.from_pretrained(path, **overrides)
            _refuse_shape_overrides(config, kwargs)
            if os.path.isdir(folder):
                save_id = check_checkpoint_files(
                    folder, config.vocab_size, config.intermediate_size, config.stem_layers, kwargs.get("variant")
                )
            if device_map is not None and config.keep_tables_on_cpu and config.stem_layers:
                dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
                kwargs["device_map"] = cls._device_map_keeping_tables_on_cpu(
                    config, device_map, kwargs.get("max_memory"), dtype
                )
        loaded = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # output_loading_info=True
        # Which save of the folder's weights this model holds: provenance files beside them (conversion report,
        # evaluation results) are matched against it, not against whatever a later save left in the folder.
        model.stem_save_id = save_id
        for table in model.base_model.stem_tables.values():
            advise_random_access(table.weight)
        return loaded

    @classmethod
    def _device_map_keeping_tables_on_cpu(
        cls, config: StemConfig, device_map, max_memory: dict | None = None, dtype: torch.dtype | str | None = None
    ) -> dict:
        """The device map transformers would use, with no entry that covers a table. Parameters outside the map load on
        CPU and get no accelerate hook, so the tables stay in host memory (memory-mapped) and each forward moves only
        the rows it needs; a "cpu" entry would instead copy the whole table to the accelerator at every forward."""
        if dtype is None or dtype == "auto":
            dtype = config.dtype or torch.float32
        with torch.device("meta"):
            model = cls(config).to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)  # sizes the map
        tables = model.base_model.stem_tables
        tables_name = next(name for name, module in model.named_modules() if module is tables)
        device_map = check_and_set_device_map(device_map)
        if isinstance(device_map, str):  # "auto", "balanced", ...: place the model as if it had no tables
            for key in list(tables.keys()):
                del tables[key]
            device_map = _get_device_map(model, device_map, max_memory, None)
        device_map = {k: v for k, v in device_map.items() if k != tables_name and not k.startswith(tables_name + ".")}
        modules = dict(model.named_modules())
        while (
            covering := next((k for k in device_map if k == "" or tables_name.startswith(k + ".")), None)
        ) is not None:
            device = device_map.pop(covering)
            prefix = f"{covering}." if covering else ""
            parent = modules[covering]
            children = [name for name, _ in parent.named_children()]
            children += [name for name, _ in parent.named_parameters(recurse=False)]
            children += [name for name, _ in parent.named_buffers(recurse=False)]
            device_map.update({prefix + name: device for name in children if prefix + name != tables_name})
        return device_map

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        is_main_process: bool = True,
        state_dict: dict | None = None,
        push_to_hub: bool = False,
        max_shard_size: int | str = "50GB",
        **kwargs,
    ) -> None:
        """`PreTrainedModel.save_pretrained`, with the tables in their own `stem-tables-XXXXX-of-YYYYY.safetensors`
        files (in `config.table_dtype`, at most `max_shard_size` each) listed with the dense shards in one
        `model.safetensors.index.json`. The save is staged in a hidden folder (beside a new `save_directory`, inside an
        existing one) and committed by renames, so an interrupted save never leaves half-written files in place of a
        good checkpoint; every weight file and the index, written last, carry one fresh save id, so that a save killed
        between its renames is refused at load rather than loaded as a mix of two saves. With `variant` ("fp16"), the
        files are named as transformers names a variant's (`model.fp16-00001-of-00001.safetensors`,
        `stem-tables.fp16-...`, `model.safetensors.index.fp16.json`) and sit beside the other variants'.

        Provenance files already in `save_directory` (`conversion_report.json`, `lm_eval_results.json`) that record an
        earlier save's id no longer describe these weights: they are kept, named in a warning, and left out of the
        model card."""
        if getattr(self, "_hf_peft_config_loaded", False) or not self.should_save_on_this_rank(is_main_process):
            # Adapters hold no tables; other ranks take part in transformers' collective steps but write nothing.
            return super().save_pretrained(
                save_directory, is_main_process, state_dict, push_to_hub, max_shard_size, **kwargs
            )
        variant = kwargs.pop("variant", None) or None
        check_variant(variant)
        hub_kwargs = {k: kwargs.pop(k) for k in ("repo_id", "commit_message", "create_pr", "private") if k in kwargs}
        if state_dict is None:
            state_dict = self.state_dict()
        tables = {name: tensor for name, tensor in state_dict.items() if TABLE_KEY.search(name)}
        dense = {name: tensor for name, tensor in state_dict.items() if name not in tables}
        offloaded = [name for name, tensor in tables.items() if tensor.device.type == "meta"]
        if offloaded:
            raise ValueError(
                f"{offloaded[0]} is offloaded to disk (on the meta device) and cannot be saved: load the model with "
                "keep_tables_on_cpu=True (the default) or without a 'disk' entry for the tables in device_map"
            )
        finer = sorted(
            {str(t.dtype)[6:] for t in tables.values() if t.itemsize > getattr(torch, self.config.table_dtype).itemsize}
        )
        if finer:
            logger.warning_once(
                f"tables held in {', '.join(finer)} (trained: train() upcasts them) are saved in config.table_dtype "
                f"{self.config.table_dtype}, which rounds away updates smaller than its spacing; "
                "model.set_table_dtype('float32') before saving keeps every update, in twice the bytes"
            )
        # So that AutoModel.from_pretrained(..., trust_remote_code=True) finds the base model too.
        if self._auto_class is not None:
            auto_map = getattr(self.config, "auto_map", None) or {}
            self.config.auto_map = {**auto_map, "AutoModel": "modeling_stem.StemModel"}
        with staged_folder(save_directory, variant) as staging:
            super().save_pretrained(staging, state_dict=dense, max_shard_size=max_shard_size, variant=variant, **kwargs)
            dtype = getattr(torch, self.config.table_dtype)
            save_id = finish_checkpoint(staging, tables, dtype, max_shard_size, self.num_parameters(), variant)
        self.stem_save_id = save_id  # the weights in memory are now those of this save
        stale = stale_provenance(save_directory, PROVENANCE_FILES)
        if stale:
            logger.warning(
                f"{save_directory}: {', '.join(stale)} describe the weights of an earlier save, not these; they are "
                "kept but left out of the model card. Re-run the conversion or evaluation, or remove them."
            )
        self._write_model_card(save_directory)
        if push_to_hub:
            repo_id = hub_kwargs.pop("repo_id", os.path.basename(os.path.abspath(save_directory)))
            self.push_to_hub(repo_id, max_shard_size=max_shard_size, token=kwargs.get("token"), **hub_kwargs)

    def _write_model_card(
        self, folder: str | os.PathLike, repo_id: str | None = None, tags: list[str] | None = None
    ) -> None:
        """Writes or refreshes `README.md` when stem_hf is installed; never replaces a card a person wrote. A card that
        cannot be rendered (say, a corrupt `conversion_report.json`) is a warning: the weights are saved by then."""
        if self._model_card_writer is None:
            return
        try:
            self._model_card_writer(folder, repo_id=repo_id, tags=[*(self.model_tags or []), *(tags or [])])
        except Exception as err:  # noqa: BLE001 - a card is never worth failing a save that already succeeded
            logger.warning(f"no model card written to {folder}: {type(err).__name__}: {err}")

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: str | None = None,
        commit_description: str | None = None,
        private: bool | None = None,
        token: bool | str | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        max_shard_size: int | str | None = "50GB",
        tags: list[str] | None = None,
    ) -> str:
        """`PushToHubMixin.push_to_hub`, uploading what `save_pretrained` writes: config, copied code, dense and table
        shards, and the stem-hf model card (with `repo_id` in its usage snippet). A card on the Hub that a person wrote
        is kept, its tags updated, as transformers does; a card stem-hf generated is refreshed. `tags` go to the card
        only. The tokenizer is pushed on its own (`tokenizer.push_to_hub`), or with the whole folder by `stem-hf push`.
        """
        from transformers.utils.hub import create_and_tag_model_card, hf_api  # only pushes need them

        api = hf_api()
        repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory() as root:
            tmp = os.path.join(root, "upload")

            def fetch(name: str) -> None:  # hf_hub_download leaves a .cache folder in local_dir: not in the upload
                path = api.hf_hub_download(repo_id, name, revision=revision, token=token, local_dir=root)
                shutil.copy(path, os.path.join(tmp, name))

            loaded_id = getattr(self, "stem_save_id", None)  # the save gives the model the pushed files' id
            self.save_pretrained(tmp, max_shard_size=max_shard_size)
            # The card also describes how the model was made and evaluated: take those files from the folder the model
            # was loaded from, else keep the repo's, so that a refreshed card never says less than the one it replaces.
            on_hub = {
                name: api.file_exists(repo_id, name, revision=revision, token=token)
                for name in ("README.md", *PROVENANCE_FILES)
            }
            pushed_id = read_save_id(tmp)
            for name in PROVENANCE_FILES:
                local = os.path.join(self.name_or_path or "", name)
                if self.name_or_path and os.path.isfile(local):
                    try:
                        with open(local, encoding="utf-8") as f:
                            record = json.load(f)
                    except ValueError:  # copied as it is: the card says what is wrong with it
                        record = None
                    if not isinstance(record, dict) or record.get(SAVE_ID_KEY) is None:
                        shutil.copy(local, os.path.join(tmp, name))  # tied to no save
                    elif record[SAVE_ID_KEY] != loaded_id:
                        logger.warning(
                            f"{local} describes other weights than the ones this model was loaded from: not pushed"
                        )
                    else:  # it describes the loaded weights, which are what this push uploads under a new save id
                        with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                            json.dump({**record, SAVE_ID_KEY: pushed_id}, f, indent=2)
                elif on_hub[name]:
                    fetch(name)
            all_tags = [*(self.model_tags or []), *(tags or [])]
            if on_hub["README.md"] and revision is not None:
                fetch("README.md")
            elif on_hub["README.md"] or self._model_card_writer is None:
                create_and_tag_model_card(repo_id, all_tags, token=token).save(os.path.join(tmp, "README.md"))
            self._write_model_card(tmp, repo_id, tags)
            return self._upload_modified_files(
                tmp,
                repo_id,
                files_timestamps={},
                commit_message=commit_message,
                token=token,
                create_pr=create_pr,
                revision=revision,
                commit_description=commit_description,
            )

    def train(self, mode: bool = True) -> "StemPreTrainedModel":
        """`nn.Module.train`. A model put in training mode stops vouching for the checkpoint it was loaded from: its
        `stem_save_id` becomes an id no save has, so results evaluated afterwards are filed under no checkpoint's
        weights (until `save_pretrained` gives it the id of what it wrote)."""
        if mode:
            self.stem_save_id = unsaved_id()
        return super().train(mode)

    def set_table_dtype(self, dtype: torch.dtype | str) -> None:
        """Casts every table to `dtype` and records it in `config.table_dtype` (what saves write and loads expect)."""
        name = str(dtype).removeprefix("torch.")
        check_table_dtype(name)
        self.config.table_dtype = name
        for table in self.base_model.stem_tables.values():
            table.to(getattr(torch, name))

    def resize_token_embeddings(
        self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, mean_resizing: bool = True
    ) -> nn.Embedding:
        """Resizes the token embedding, the LM head and every STEM table. New table rows are the mean of the existing
        rows when `mean_resizing` (the default), else drawn from the xavier-normal init of a fresh table."""
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        self.base_model.stem_tables.resize(embeddings.num_embeddings, mean_resizing)
        return embeddings

    # Accounting. Conventions follow the paper: the token embedding and the LM head count as active parameters, and a
    # STEM layer activates one table row (intermediate_size parameters) per token.
    def num_table_parameters(self) -> int:
        """Parameters held in STEM tables."""
        return sum(p.numel() for p in self.base_model.stem_tables.parameters())

    def num_active_parameters(self) -> int:
        """Parameters that one token's forward uses: everything but the tables, plus one row per STEM layer."""
        rows = len(self.config.stem_layers) * self.config.intermediate_size
        return self.num_parameters() - self.num_table_parameters() + rows

    def num_dense_parameters(self) -> int:
        """Parameters of the dense model of the same shape (each table replaced by an up-projection)."""
        config = self.config
        up_proj = config.hidden_size * config.intermediate_size + (config.intermediate_size if config.mlp_bias else 0)
        return self.num_parameters() - self.num_table_parameters() + len(config.stem_layers) * up_proj

    def flops_per_token(self, context_length: int, dense: bool = False) -> int:
        """Forward FLOPs (2 per multiply-add) of one token that attends to `context_length` positions, LM head included.

        `dense=True` gives the dense model of the same shape. Per STEM layer, STEM saves `2 * hidden * intermediate`
        FLOPs. For a causal sequence of length L the mean context is (L + 1) / 2; the paper's saved-fraction formula
        `d_ff / (4d + 2L + 3 d_ff)` uses L.
        """
        config = self.config
        d, d_ff, hd = config.hidden_size, config.intermediate_size, config.head_dim
        q_width, kv_width = config.num_attention_heads * hd, config.num_key_value_heads * hd
        attention = 2 * d * q_width + 2 * d * kv_width + 2 * q_width * context_length
        n_stem = 0 if dense else len(config.stem_layers)
        mlp = 3 * d * d_ff * (config.num_hidden_layers - n_stem) + 2 * d * d_ff * n_stem
        return 2 * (attention * config.num_hidden_layers + mlp + d * config.vocab_size)


class StemModel(StemPreTrainedModel):
    def __init__(self, config: StemConfig):
        super().__init__(config)
        # A config edited after construction may hold a ratio string again: the model builds from the explicit list.
        config.stem_layers = resolve_stem_layers(config.stem_layers, config.num_hidden_layers)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [StemDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.stem_tables = StemTables(config)
        # Left out of device maps on purpose (see `_device_map_keeping_tables_on_cpu`); a non-None value makes
        # transformers skip accelerate's check that every parameter has a device.
        self._no_placement_params = [f"stem_tables.{i}.weight" for i in config.stem_layers]
        self.norm = StemRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = StemRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        stem_input_ids: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        r"""
        stem_input_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            The token ids used for the STEM table lookups; defaults to `input_ids`. Passing other ids than the text's
            own edits what the model knows about those positions (the paper's knowledge editing).
        """
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        given = "input_ids" if input_ids is not None else "inputs_embeds"
        if (input_ids if input_ids is not None else inputs_embeds).shape[1:2] == (0,):
            shape = tuple((input_ids if input_ids is not None else inputs_embeds).shape)
            raise ValueError(f"{given} has shape {shape}: no position to run; give at least one token")
        vocab_size = self.config.vocab_size
        if input_ids is not None:
            check_token_ids(input_ids, vocab_size, "input_ids")
        if stem_input_ids is None:
            stem_input_ids = input_ids
        elif stem_input_ids is not input_ids:
            check_token_ids(stem_input_ids, vocab_size, "stem_input_ids")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)

        stem_rows = None
        if self.config.stem_layers:
            if stem_input_ids is None:
                raise ValueError(
                    f"this model has STEM layers {self.config.stem_layers}, whose tables are indexed by token ids: "
                    "pass `stem_input_ids` (batch_size, sequence_length) along with `inputs_embeds` (with PEFT prompt "
                    "tuning, pass the text's input ids as `stem_input_ids`)"
                )
            batch, length = inputs_embeds.shape[:2]
            # Embeddings may start with soft prompts (PEFT prompt tuning): then the ids cover the positions after them.
            num_soft = length - stem_input_ids.shape[-1]
            soft_allowed = input_ids is None and 0 <= num_soft < length
            if stem_input_ids.ndim != 2 or stem_input_ids.shape[0] != batch or not (num_soft == 0 or soft_allowed):
                raise ValueError(
                    f"stem_input_ids has shape {tuple(stem_input_ids.shape)} but the inputs have (batch_size, "
                    f"sequence_length) = {(batch, length)}: give one table id per input position (with "
                    "`inputs_embeds`, fewer ids mean that the first positions are soft prompts without a token)"
                )
            stem_rows = self.stem_tables(stem_input_ids)
            if num_soft:
                stem_rows = StemSoftPromptRows(stem_rows, num_soft)

        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)

        if position_ids is None:
            past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                stem_rows=stem_rows,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=past_key_values)


class StemForCausalLM(StemPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: StemConfig):
        super().__init__(config)
        self.model = StemModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._no_placement_params = [f"model.{name}" for name in self.model._no_placement_params]
        self.post_init()

    def generate(self, inputs: torch.Tensor | None = None, *args, **kwargs):
        """`GenerationMixin.generate`, after checking that `stem_input_ids` gives one id per prompt position (the
        prompt being `inputs_embeds` when given, else `inputs`/`input_ids`): a shorter or longer one would shift every
        later lookup. With `inputs_embeds` on a model with STEM layers, `stem_input_ids` is required."""
        stem_input_ids = kwargs.get("stem_input_ids")
        embeds = kwargs.get("inputs_embeds")
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        prompt = embeds if embeds is not None else ids
        if stem_input_ids is None and embeds is not None and self.config.stem_layers:
            raise ValueError(
                f"generate(inputs_embeds=...): this model's STEM layers {self.config.stem_layers} look up table rows "
                "by token id; pass `stem_input_ids` (batch_size, prompt_length) with the prompt's token ids"
            )
        if stem_input_ids is not None and embeds is not None and ids is not None and ids.numel():
            raise ValueError(
                "generate: with stem_input_ids, give the prompt as input_ids or as inputs_embeds, not both (which of "
                "them the tables should follow would be ambiguous)"
            )
        # An assistant model's generate runs again on the prompt plus the tokens accepted so far.
        assisting = getattr(kwargs.get("generation_config"), "is_assistant", False)
        if stem_input_ids is not None and prompt is not None and stem_input_ids.shape != prompt.shape[:2]:
            if assisting and stem_input_ids.shape[0] == prompt.shape[0] and stem_input_ids.shape[1] < prompt.shape[1]:
                return super().generate(inputs, *args, **kwargs)
            raise ValueError(
                f"stem_input_ids has shape {tuple(stem_input_ids.shape)} but the prompt has (batch_size, length) = "
                f"{tuple(prompt.shape[:2])}: give one table id per prompt position"
            )
        return super().generate(inputs, *args, **kwargs)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        past_key_values: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        stem_input_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> dict:
        """Lets `generate` take `stem_input_ids` for the prompt (and `inputs_embeds` with them): the tokens it generates
        look up their own rows. The step's ids always travel as `stem_input_ids`, so that a wrapper that swaps
        `input_ids` for embeddings (PEFT prompt tuning) still sends the tables their ids."""
        model_inputs = super().prepare_inputs_for_generation(
            input_ids,
            past_key_values=past_key_values,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            **kwargs,
        )
        step = model_inputs.get("input_ids")
        if stem_input_ids is None:
            if step is not None and self.config.stem_layers:
                model_inputs["stem_input_ids"] = step  # the same tensor: forward checks it once
            return model_inputs
        stem_input_ids = stem_input_ids.to(input_ids.device)
        if step is None:
            step = model_inputs["inputs_embeds"]
        if inputs_embeds is None and input_ids.shape[1] < stem_input_ids.shape[1]:
            # Chunked prefill (`prefill_chunk_size`): input_ids is one chunk of the prompt, after what the cache holds.
            start = past_key_values.get_seq_length() if past_key_values is not None else 0
            model_inputs["stem_input_ids"] = stem_input_ids[:, start : start + step.shape[1]]
            return model_inputs
        # With a prompt given as embeddings, input_ids holds only the generated tokens.
        generated = input_ids if inputs_embeds is not None else input_ids[:, stem_input_ids.shape[1] :]
        full = torch.cat([stem_input_ids, generated], dim=1)
        model_inputs["stem_input_ids"] = full[:, full.shape[1] - step.shape[1] :]
        return model_inputs

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        stem_input_ids: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        r"""
        stem_input_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            The token ids used for the STEM table lookups; defaults to `input_ids`.

        ```python
        >>> from transformers import AutoModelForCausalLM
        >>> model = AutoModelForCausalLM.from_pretrained("path/to/stem-model", trust_remote_code=True)
        >>> out = model.generate(input_ids, max_new_tokens=20)
        ```"""
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            stem_input_ids=stem_input_ids,
            **kwargs,
        )
        # An int keeps the last positions (0 keeps all); a tensor names the positions to keep.
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        hidden_states = outputs.last_hidden_state[:, keep, :]
        logits = self.lm_head(hidden_states)

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


__all__ = ["StemForCausalLM", "StemModel", "StemPreTrainedModel"]
