"""STEM: Scaling Transformers with Embedding Modules (arXiv 2601.10639) as a transformers causal LM.

A Llama-family decoder in which the FFN of each layer listed in `config.stem_layers` computes
`down_proj(SiLU(gate_proj(x)) * U_l[t])`: the up-projection is replaced by a row of a per-layer table `U_l` indexed by
the input token id `t`. Every other weight keeps `LlamaForCausalLM`'s name, so a Llama state dict loads as is when
`stem_layers` is empty.

Copied next to the weights by `save_pretrained`: imports nothing beyond torch and transformers.
"""

import functools
import importlib.util
import inspect
import math
import os
from collections.abc import Callable, Container, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import NamedTuple, Protocol

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .checkpoint_stem import FREED_TABLES, load_checkpoint, save_checkpoint, unsaved_id
from .compat_stem import (
    CACHE_ARG,
    CACHE_ARGS,
    LAYER_UPDATES_PAGED_CACHE,
    check_model_kwargs,
    check_transformers_version,
    rename_cache,
    takes_cache,
)
from .configuration_stem import StemConfig, check_table_dtype

logger = logging.get_logger(__name__)
check_transformers_version()


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

    @dynamic_rope_update  # no `torch.no_grad()`: nothing here requires grad, and its context costs every forward
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
        self.qk_norm = config.qk_norm  # read per layer per step: a config's attribute access is slow

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
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        if self.qk_norm:
            query_states = self.q_norm(query_states)
            key_states = self.k_norm(key_states)
        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if cache is not None and LAYER_UPDATES_PAGED_CACHE:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
        elif isinstance(cache, Cache):
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)
        elif cache is not None:  # continuous batching's paged cache before transformers 5.24: updated by attention
            kwargs = {**kwargs, "cache": cache}

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


def settle(weight: torch.Tensor) -> None:
    """Waits for a write of `weight` still running on another thread and raises what it raised. A writer
    (`stem_hf.training.RowSparseAdamW(write_behind=True)`, which steps host tables while the accelerator goes on)
    leaves it in `weight.stem_pending_write`, an object with `result()`: on the weight itself, so that every copy of
    this file (the package's, a checkpoint's remote code) sees it. A writer writes behind only a weight marked
    `stem_reads_wait` (by `StemTables.train()`): an older copy of this file, which does not wait, never marks one."""
    write = getattr(weight, "stem_pending_write", None)  # None: a constant under torch.compile
    if write is not None:
        write.result()


class StemTable(nn.Embedding):
    """One STEM layer's `[vocab_size, intermediate_size]` table. Its own class so that `_init_weights` can tell it from
    the token embedding and give it the paper's xavier-normal init. A state dict saved or loaded, a cast, a move, a copy
    or a pickle waits for a write behind first (`settle`)."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        settle(self.weight)
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        settle(self.weight)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn, recurse=True):
        settle(self.weight)  # a cast or move copies the written rows
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict:
        settle(self.weight)  # a deep copy or pickle copies the written rows
        return super().__getstate__()


# Host tables serving an accelerator: one worker thread gathers rows into pinned memory and starts their copy on a side
# stream, this many STEM layers ahead of the layer that reads them.
HOST_ROWS_AHEAD = 2
# An inference forward of at most this many distinct ids (a decoding step) has every host table's rows fetched at once
# by the thread that runs it: there, handing each layer's few rows to the worker costs that thread (wake-ups, the GIL)
# more than the gathers do, and a decoding step waits on that thread's launches. Larger forwards, and training forwards
# (which also wait for each table's write behind layer by layer), are pipelined.
HOST_AT_ONCE_MAX_IDS = 128
_Fetched = tuple[torch.Tensor, "torch.cuda.Event | None"]  # a layer's rows on the ids' device, and their copy's event
_ROW_WORKER: ThreadPoolExecutor | None = None
_COPY_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}
_GRAD_COPY_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def _side_stream(streams: dict, device: torch.device) -> "torch.cuda.Stream":
    """`device`'s stream in `streams`, made the first time it is asked for."""
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


def _row_worker() -> ThreadPoolExecutor:
    global _ROW_WORKER
    if _ROW_WORKER is None:
        _ROW_WORKER = ThreadPoolExecutor(1, thread_name_prefix="stem-host-rows")
    return _ROW_WORKER


def _forget_row_worker() -> None:
    """A forked child has no worker thread, only the parent's executor, which would take work and never run it."""
    global _ROW_WORKER
    _ROW_WORKER = None
    _COPY_STREAMS.clear()
    _GRAD_COPY_STREAMS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_row_worker)


def _hooked(module: nn.Module) -> bool:
    """Whether something reads or replaces `module`'s forward: its own hooks, or an accelerate hook (which replaces
    `forward` itself)."""
    if module._forward_hooks or module._forward_pre_hooks:
        return True
    # Accelerate sets `_hf_hook` in the instance's dict, where eager code finds it without the AttributeError that
    # `hasattr` raises and catches inside `nn.Module.__getattr__` (asked per layer per decoding step); dynamo guards
    # `hasattr`, not the dict's keys.
    return hasattr(module, "_hf_hook") if torch.compiler.is_compiling() else "_hf_hook" in module.__dict__


def _usual(table: nn.Embedding) -> bool:
    """A lookup with none of `nn.Embedding`'s options that change rows or their gradient."""
    return table.padding_idx is None and table.max_norm is None and not table.scale_grad_by_freq


def _trained_parts(module: nn.Module) -> list[nn.Module]:
    """What may train of a table's module: the table (first); under PEFT's trainable tokens, the trained rows too."""
    table = base_table(module)
    return [module] if table is module else [table, getattr(module.token_adapter, "trainable_tokens_delta", table)]


def _upcasts(weight: torch.Tensor) -> bool:
    """Whether `upcast_trainable` casts `weight`: it trains in a lower precision than float32, and has data here."""
    low = weight.requires_grad and weight.dtype != torch.float32
    return low and weight.device.type != "meta" and type(weight).__name__ != "DTensor"


class StemTrainedRows(NamedTuple):
    """PEFT's trainable tokens on a STEM table (`trainable_token_indices`, which `stem_hf.training.lora_config` sets):
    the table, and the active adapter's token ids with the rows that replace the table's for them."""

    table: nn.Embedding
    ids: list[int]
    rows: torch.Tensor


def base_table(module: nn.Module) -> nn.Module:
    """The table under PEFT's trainable tokens (its `weight` would merge the adapter's rows into a copy of the whole
    table), or `module` itself."""
    adapter = module._modules.get("token_adapter")
    base = getattr(adapter, "base_layer", None)
    return base if isinstance(base, nn.Embedding) else module


def trained_tokens(module: nn.Module) -> StemTrainedRows | None:
    """The trained rows of PEFT's trainable tokens around a plain table, where the layer can look the table up as it
    looks up any table and put the trained rows in after: PEFT's own forward copies the whole table with those rows
    in, at every forward and on every read of `weight`, and backward makes a `[vocab, d_ff]` gradient to pick them out
    of. None for anything else, which its own forward serves: no token adapter, adapters disabled or merged, more than
    one active, hooks (PEFT's mixed-batch `adapter_names` is one), a table with `nn.Embedding` options, repeated ids."""
    adapter = module._modules.get("token_adapter")
    if adapter is None:
        return None
    table = getattr(adapter, "base_layer", None)
    if type(table) is not StemTable or not _usual(table) or any(map(_hooked, (module, adapter, table))):
        return None
    if getattr(module, "disable_adapters", True) or getattr(adapter, "disable_adapters", True):
        return None
    names, deltas = getattr(adapter, "active_adapters", None), getattr(adapter, "trainable_tokens_delta", None)
    if getattr(adapter, "merged", True) or not isinstance(names, list) or len(names) != 1 or deltas is None:
        return None
    ids = getattr(adapter, "token_indices", {}).get(names[0])
    if names[0] not in deltas or names[0] not in getattr(module, "_adapters", ()) or ids is None:
        return None
    rows = deltas[names[0]]
    if rows.shape != (len(ids), table.embedding_dim):
        return None
    ids, distinct, _ = _checked_ids(rows, ids)
    return StemTrainedRows(table, ids, rows) if distinct else None


# Per trained rows (an adapter's parameter): a copy of their ids, whether those are distinct, and per device the ids
# sorted with each one's place among the rows. Kept, so that a forward compares the ids with the copy and no more.
_TRAINED_IDS = WeakIdKeyDictionary()


def _checked_ids(rows: torch.Tensor, ids: list[int]) -> tuple[list[int], bool, dict]:
    """`ids` as kept for `rows` (compared whole: a list changed in place is seen), whether they are distinct, and the
    sorted index kept for them per device."""
    if torch.compiler.is_compiling():
        return list(ids), len(set(ids)) == len(ids), {}
    held = _TRAINED_IDS.get(rows)
    if held is None or held[0] != ids:
        held = _TRAINED_IDS[rows] = (list(ids), len(set(ids)) == len(ids), {})
    return held


def unwrapped_tables(model: nn.Module, what: str) -> "StemTables":
    """`model`'s tables, for `what` to copy or write their rows: raises, naming `what`, where `model` is no STEM model
    (a PEFT model among them) or PEFT wraps its tables (trainable tokens, `modules_to_save`), whose rows a copy would
    take merged once, never following the adapter, and a write would put into a merged copy, lost."""
    # Not this file's classes: a checkpoint loaded with trust_remote_code brings its own copy of them
    tables = getattr(getattr(model, "base_model", None), "stem_tables", None)
    if not isinstance(tables, nn.ModuleDict):
        raise ValueError(
            f"{what}: {type(model).__name__} is not a STEM model (StemForCausalLM, StemModel); for a PEFT model, use "
            "the model its adapter merges into: peft_model.merge_and_unload()"
        )
    wrapped = {key: type(table).__name__ for key, table in tables.items() if not isinstance(table, nn.Embedding)}
    if wrapped:
        raise ValueError(
            f"{what}: STEM tables {wrapped} are wrapped (PEFT's trainable tokens or modules_to_save): merge the "
            "adapter into the model first (peft_model.merge_and_unload())"
        )
    return tables


def trained_index(trained: StemTrainedRows, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The trained ids sorted, on `device`, and each one's place among the trained rows. Kept per trained rows and
    device: made from the host's list of ids, a copy that waits for the device, once, not per layer and forward."""
    held = None if torch.compiler.is_compiling() else _TRAINED_IDS.get(trained.rows)
    if held is None or held[0] is not trained.ids:  # under compile, or ids not `trained_tokens`'s: made afresh
        return torch.tensor(trained.ids, device=device).sort()
    if device not in held[2]:
        held[2][device] = torch.tensor(trained.ids, device=device).sort()
    return held[2][device]


def with_trained_rows(rows: torch.Tensor, ids: torch.Tensor, trained: StemTrainedRows) -> torch.Tensor:
    """`rows` (of `ids`) with the trained rows in place of the table's at their ids, as PEFT's merged table gives them:
    the gradient reaches the trained rows through the positions holding their ids only, and no `[vocab, d_ff]` tensor
    is made."""
    known, order = trained_index(trained, ids.device)
    at = torch.searchsorted(known, ids.contiguous()).clamp_(max=len(known) - 1)
    hit = known[at] == ids
    return torch.where(hit.unsqueeze(-1), trained.rows.to(rows)[order[at]], rows)


# torch's CPU `index_select` copies a row of fewer elements than this (ATen's GRAIN_SIZE) with one memcpy, in parallel
# over rows; a wider row with a parallel copy of its own, a round trip through the thread pool per row.
INDEX_SELECT_GRAIN = 32768
MIN_PIECE = 1024  # narrower pieces would cost more in index arithmetic than the wide rows' round trips


@functools.cache
def row_pieces(row: int) -> int:
    """Into how many equal pieces `gather_rows` cuts a row of `row` elements: the fewest below `INDEX_SELECT_GRAIN`
    (1 for rows already below it, and for rows that no split leaves pieces of at least `MIN_PIECE`)."""
    for pieces in range(1, row // MIN_PIECE + 1):
        if row % pieces == 0 and row // pieces < INDEX_SELECT_GRAIN:
            return pieces
    return 1


def gather_rows(source: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.index_select(source, 0, ids, out=out)` for host rows of any width at the speed of one memcpy per row:
    a contiguous CPU `source` whose rows reach `INDEX_SELECT_GRAIN` elements (a token's rows for every STEM layer; a
    wide table) is gathered as rows cut in `row_pieces` pieces, each below it. The same checks: an id outside
    `[0, len(source))` makes a piece's index fall outside too, and ids of a dtype index_select refuses go to it."""
    pieces = row_pieces(source[0].numel()) if source.dim() > 1 and source.shape[0] else 1
    shape = (len(ids), *source.shape[1:]) if ids.dim() == 1 else None
    flat = source.device.type == "cpu" and source.is_contiguous() and shape is not None
    flat = flat and ids.dtype in (torch.int32, torch.int64)  # arithmetic on other dtypes would wrap or cast
    if out is not None:  # anything but a contiguous buffer of the result's shape: as index_select takes it
        flat = flat and out.is_contiguous() and out.shape == shape and out.dtype == source.dtype
    if pieces == 1 or not flat:
        return torch.index_select(source, 0, ids, out=out)
    piece_ids = (ids.long()[:, None] * pieces + torch.arange(pieces, device=ids.device)).view(-1)
    width = source[0].numel() // pieces
    if out is None:  # no `out=`: differentiable, as index_select is
        return torch.index_select(source.view(-1, width), 0, piece_ids).view(shape)
    torch.index_select(source.view(-1, width), 0, piece_ids, out=out.view(-1, width))
    return out


def distinct_sparse_grad(weight: torch.Tensor, unique: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A table's sparse gradient of its distinct, sorted rows `unique`, whose indices are also kept on the weight
    (`stem_grad_rows`): autograd's accumulation drops the flag that says the gradient is coalesced, and an optimizer
    that finds the same indices in `weight.grad` knows they are distinct and sorted without reading them (a host
    sync on an accelerator). The weight holds them, so their memory cannot be another tensor's while it does."""
    indices = unique[None]
    weight.stem_grad_rows = indices
    return torch.sparse_coo_tensor(indices, rows, weight.shape, is_coalesced=True, check_invariants=False)


def copies_grad_behind(weight: torch.Tensor) -> bool:
    """Whether a host table's sparse gradient may cross from the accelerator while the backward goes on
    (`_copy_grad_behind`): whether nothing reads it before the backward ends. Only for a weight marked
    `stem_grad_copies_behind` (`stem_hf.training.copy_table_grads_behind`, which `StemTrainer` calls for a loss that is
    the model's own): a term of a loss on the weight itself would be added to it at once. Not where autograd adds it
    to another gradient at once (one already there: accumulation; another of this backward still crossing: the table
    used twice), where the weight has a gradient hook, where the backward builds a graph of its own (`create_graph`:
    autograd clones the gradient), checks each output (anomaly mode) or runs under a torch dispatch mode
    (`FlopCounterMode`, `HostSyncCounter`: autograd clones the gradient there too, reading it before it has arrived),
    or under torch.distributed, whose wrappers hook a gradient's accumulation where no hook shows on the weight."""
    if not weight.__dict__.get("stem_grad_copies_behind", False):
        return False
    hooked = weight._backward_hooks or weight._post_accumulate_grad_hooks
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    # The mark of a copy of this backward still crossing (a backward that raised never clears its own: it is stale)
    crossing = weight.__dict__.get("stem_grad_crossing") == torch._C._current_graph_task_id()
    dispatched = torch._C._len_torch_dispatch_stack() > 0
    unusual = torch.is_grad_enabled() or torch.is_anomaly_enabled() or dispatched or distributed
    return weight.grad is None and not crossing and not hooked and not unusual


def _copy_grad_behind(weight: torch.Tensor, host: torch.Tensor, grad: torch.Tensor) -> None:
    """Copies `grad` (CUDA) into pinned `host` on a side stream, so the backward's next kernels run while it crosses;
    the backward does not return before it has arrived (a callback at its end waits for the copy's event). Until then
    `weight` is marked `stem_grad_crossing` with the backward's graph task: another gradient of it in this backward is
    copied blocking, after this one."""
    device = grad.device
    stream = _side_stream(_GRAD_COPY_STREAMS, device)
    stream.wait_stream(torch.cuda.current_stream(device))  # the gradient is made on the main stream
    with torch.cuda.stream(stream):
        host.copy_(grad, non_blocking=True)
        arrived = torch.cuda.Event()
        arrived.record(stream)
    grad.record_stream(stream)  # freed on the main stream while the side one may still read it
    task = weight.stem_grad_crossing = torch._C._current_graph_task_id()

    def arrive() -> None:
        arrived.synchronize()
        if weight.__dict__.get("stem_grad_crossing") == task:
            del weight.stem_grad_crossing

    torch.autograd.Variable._execution_engine.queue_callback(arrive)


def _settle_grad_copies(device: torch.device) -> None:
    """Waits for the gradient copies behind still crossing from `device` (an earlier one of this backward may be the
    gradient autograd is about to add to)."""
    stream = _GRAD_COPY_STREAMS.get(device)
    if stream is not None:
        stream.synchronize()


def distinct_rows_grad(
    weight: torch.Tensor, unique: torch.Tensor, inverse: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    """`weight`'s sparse gradient from each position's row gradient `grad`, summed into the distinct rows `unique`
    (`inverse`: each position's place among them) by embedding's own backward: deterministic on CUDA (sorted, no
    atomics), no host sync."""
    rows = torch.ops.aten.embedding_dense_backward(grad, inverse, len(unique), -1, False)
    return distinct_sparse_grad(weight, unique, rows)


class StemHostRowsGrad(torch.autograd.Function):
    """Rows gathered on the host and copied to the accelerator, made differentiable in the host table: the backward
    copies the distinct rows' gradients back (from CUDA behind the backward's next kernels where `copies_grad_behind`)
    and hands the table a sparse gradient (if the table is `sparse`) or a dense one, as the table's own lookup would."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, unique: torch.Tensor, rows: torch.Tensor, sparse: bool) -> torch.Tensor:
        ctx.save_for_backward(unique)
        ctx.weight = weight  # an input leaf: no reference cycle
        ctx.shape, ctx.dtype, ctx.sparse = weight.shape, weight.dtype, sparse
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (unique,) = ctx.saved_tensors
        grad = grad.to(ctx.dtype)  # cast where the rows are: on an accelerator, before they cross
        if grad.device != unique.device:
            # Into pinned memory: a DMA at the link's speed, where a pageable one is staged by the driver.
            cuda = grad.device.type == "cuda"
            host = torch.empty(grad.shape, dtype=grad.dtype, device=unique.device, pin_memory=cuda)
            if cuda and ctx.sparse and copies_grad_behind(ctx.weight):  # a dense one is scattered at once, below
                _copy_grad_behind(ctx.weight, host, grad)
                grad = host
            else:  # blocking, so autograd never sees the host gradient before its bytes have arrived
                if cuda:
                    _settle_grad_copies(grad.device)
                grad = host.copy_(grad)
        if ctx.sparse:
            return distinct_sparse_grad(ctx.weight, unique, grad), None, None, None
        return grad.new_zeros(ctx.shape).index_copy_(0, unique, grad), None, None, None


class StemDistinctRowsGrad(torch.autograd.Function):
    """The lookup of a `sparse` table on the device of the ids, whose backward sums each position's gradient into its
    row among the forward's distinct ids (sorted) and hands the table a coalesced sparse gradient of those rows.
    `nn.Embedding`'s sparse gradient repeats a row per position instead, and whoever reads it must coalesce it: a sort
    and, on an accelerator, a host sync per table and step."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, ids: torch.Tensor, unique: torch.Tensor, inverse: torch.Tensor):
        ctx.save_for_backward(unique, inverse)
        ctx.weight = weight  # an input leaf: no reference cycle
        return nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        unique, inverse = ctx.saved_tensors
        return distinct_rows_grad(ctx.weight, unique, inverse, grad), None, None, None


class StemLookup(NamedTuple):
    """Rows a STEM layer gathers inside its own kernel, `table[index]`: a table and the forward's ids, or the distinct
    rows a forward moved to the accelerator and each position's place among them (`StemTableRows.lookup`). With
    `unique` and `inverse` (the forward's distinct ids, each position's place among them) the table's gradient is
    sparse over `unique`, as `StemDistinctRowsGrad` gives it."""

    table: torch.Tensor
    index: torch.Tensor
    unique: torch.Tensor | None = None
    inverse: torch.Tensor | None = None


def gathered(lookup: StemLookup) -> torch.Tensor:
    """The rows of `lookup`, gathered as the unfused path gathers them (with the same gradient)."""
    if lookup.unique is not None:
        return StemDistinctRowsGrad.apply(lookup.table, lookup.index, lookup.unique, lookup.inverse)
    return nn.functional.embedding(lookup.index, lookup.table)


def gated_lookup(gate: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`SiLU(gate) * table[index]` in `gate`'s dtype: a STEM FFN's product before its down projection."""
    return nn.functional.silu(gate) * nn.functional.embedding(index, table).to(gate.dtype)


def gated_lookup_grads(
    grad: torch.Tensor, gate: torch.Tensor, table: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_lookup`'s gradients, computed in float32: `gate`'s, and each position's row's (in `table`'s dtype, not
    yet summed into the table's rows)."""
    x, grad = gate.float(), grad.float()
    sigmoid = torch.sigmoid(x)
    rows = nn.functional.embedding(index, table).to(gate.dtype).float()
    grad_gate = grad * rows * sigmoid * (1 + x * (1 - sigmoid))  # SiLU'(x) = sigmoid(x) (1 + x (1 - sigmoid(x)))
    return grad_gate.to(gate.dtype), (grad * x * sigmoid).to(table.dtype)


_COMPILED: dict[tuple[Callable, str], Callable] = {}
_FUSES_ON: dict[torch.device, bool] = {}
# Under `fused_table_lookup=None`, forwards of fewer tokens (decoding steps) take the unfused path: they are bound by
# kernel launches, not by memory, and a token count of 1 would be a compile of its own.
FUSED_LOOKUP_MIN_TOKENS = 128


def _compiled(fn: Callable, device_type: str) -> Callable:
    """`fn` compiled by inductor for `device_type`, static but for the axes `rows_dynamic` marks (`dynamic=False`:
    another width is a compile of its own, never a symbolic one). Not `fullgraph`: where dynamo cannot take the frame
    (under a user's torch dispatch mode, such as `FlopCounterMode`) it runs eager."""
    if (fn, device_type) not in _COMPILED:
        _COMPILED[fn, device_type] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn, device_type]


def rows_dynamic(*tensors: torch.Tensor | None) -> None:
    """Marks the first axis of each of `tensors` (tokens; a table's rows) dynamic in every compile it enters: one
    compile serves every token and row count, while the width (d_ff) stays a constant of the kernel, whose row loads
    inductor can then vectorize (with a symbolic width it could not: `benchmarks/bench_lookup_kernel.py`)."""
    for tensor in tensors:
        if tensor is not None and tensor.dim():
            torch._dynamo.maybe_mark_dynamic(tensor, 0)


def _launch_failed(error: Exception) -> bool:
    """Whether `error`, raised by a compiled kernel, is Triton's own (a kernel it built but cannot launch on this GPU:
    out of resources, an unsupported instruction), not one the inputs or the eager code would raise too."""
    triton = (type(error).__module__ or "").split(".")[0] == "triton"
    return triton or (isinstance(error, RuntimeError) and str(error).startswith("Triton Error"))


def _run_compiled(fn: Callable, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """`fn(*args)` compiled, dynamic over the first axis of its arguments (`rows_dynamic`); where inductor cannot
    build it for this device type on this machine (no working compiler or Triton), or Triton cannot launch what it
    built, `fn` as it is, from then on, with a warning. Any other error is raised."""
    device_type = args[0].device.type
    rows_dynamic(*args)
    try:
        return _compiled(fn, device_type)(*args)
    except torch._dynamo.exc.BackendCompilerFailed as error:
        problem, failure = f"inductor cannot compile {fn.__name__} for {device_type}", error
    except Exception as error:
        if not _launch_failed(error):
            raise
        problem, failure = f"Triton cannot launch the kernel of {fn.__name__} for {device_type}", error
    logger.warning_once(f"fused_table_lookup: {problem}, which runs eager: {failure}")
    _COMPILED[fn, device_type] = fn
    return fn(*args)


class StemGatedLookup(torch.autograd.Function):
    """`gated_lookup` with autograd: forward and backward each one compiled kernel, which saves `gate` only (the
    unfused path keeps `SiLU(gate)` and the gathered rows too). The table's gradient sums the positions' into its rows
    by embedding's own backward: sparse over the distinct rows where `unique` is given, else dense."""

    @staticmethod
    def forward(ctx, gate, table, index, unique, inverse):
        # A table (a parameter) stays an attribute, as `StemDistinctRowsGrad` keeps it: saved, saved-tensor hooks
        # (offloading activations) would copy the whole table. Anything else (rows moved from host memory) is saved.
        parameter = isinstance(table, nn.Parameter)
        ctx.table, ctx.version = (table, table._version) if parameter else (None, None)
        ctx.save_for_backward(gate, None if parameter else table, index, unique, inverse)
        return _run_compiled(gated_lookup, gate.detach(), table.detach(), index)  # one variant: no grad flags

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, table, index, unique, inverse = ctx.saved_tensors
        if table is None:
            table = ctx.table
            if table._version != ctx.version:  # what saving it would have caught
                raise RuntimeError(
                    "a STEM table was modified in place between the forward and the backward of its fused lookup"
                )
        if torch.is_grad_enabled():  # create_graph: differentiable operations, so second derivatives keep every term
            grad_gate, grad_rows = gated_lookup_grads(grad, gate, table, index)
        else:
            grad_gate, grad_rows = _run_compiled(gated_lookup_grads, grad, gate, table.detach(), index)
        grad_table = None
        if ctx.needs_input_grad[1] and unique is not None:
            grad_table = distinct_rows_grad(table, unique, inverse, grad_rows)
        elif ctx.needs_input_grad[1]:
            grad_table = torch.ops.aten.embedding_dense_backward(grad_rows, index, table.shape[0], -1, False)
        return grad_gate if ctx.needs_input_grad[0] else None, grad_table, None, None, None


def fused_gated_lookup(gate: torch.Tensor, lookup: StemLookup) -> torch.Tensor:
    """`gated_lookup` of `lookup` as one kernel (`StemGatedLookup` under autograd), compiled by inductor: the rows are
    read where the product is computed, never written as a `[tokens, d_ff]` tensor of their own, and the activation
    and the product are no passes of their own. Traced as it is inside a compiled model, whose compile fuses it."""
    table, index = lookup.table, lookup.index
    if torch.compiler.is_compiling():
        return gated_lookup(gate, table, index)
    # One token axis: the batch's and the sequence's sizes would each be a shape the compile specializes (size 1).
    flat, positions = gate.reshape(-1, gate.shape[-1]), index.reshape(-1)
    if torch.is_grad_enabled() and (gate.requires_grad or table.requires_grad):
        inverse = None if lookup.inverse is None else lookup.inverse.reshape(-1)
        return StemGatedLookup.apply(flat, table, positions, lookup.unique, inverse).view(gate.shape)
    return _run_compiled(gated_lookup, flat.detach(), table.detach(), positions).view(gate.shape)


def lookup_fuses(config: StemConfig, ids: torch.Tensor) -> bool:
    """Whether STEM layers gather the rows of a forward of `ids` inside their own kernel, as `config.fused_table_lookup`
    says: True always, False never, None (the default) for forwards of at least `FUSED_LOOKUP_MIN_TOKENS` tokens on a
    device `fuses_lookups_on`."""
    if config.fused_table_lookup is None:
        return ids.numel() >= FUSED_LOOKUP_MIN_TOKENS and fuses_lookups_on(ids.device)
    return config.fused_table_lookup


def fuses_lookups_on(device: torch.device) -> bool:
    """Whether `config.fused_table_lookup=None` (the default) fuses on `device`: CUDA where Triton, which inductor
    writes its kernels in, is installed and the GPU is one it supports (compute capability 7.0 or newer). Also where
    `RowSparseAdamW(compiled_rows=None)` compiles its row update."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if device not in _FUSES_ON:
        triton = importlib.util.find_spec("triton") is not None
        _FUSES_ON[device] = triton and torch.cuda.get_device_capability(device) >= (7, 0)
    return _FUSES_ON[device]


class StemTableRows:
    """The table rows of one batch, handed out per STEM layer.

    A table on the device of the ids is looked up by the layer that asks, inside its (possibly checkpointed)
    forward, so eager activation checkpointing recomputes rows instead of keeping them. A table in host memory serving a
    model on an accelerator is read on the host for the batch's distinct ids only, and only those rows cross: a worker
    thread gathers them into pinned memory and copies them on a side stream `HOST_ROWS_AHEAD` STEM layers ahead, so
    the reads and copies overlap the layers before; an inference forward of at most `HOST_AT_ONCE_MAX_IDS` distinct
    ids (a decoding step) gathers every table's rows at once on its own thread, with one copy. Rows stay
    differentiable in the host table (`StemHostRowsGrad`).
    An offload engine returns an object with the same `__getitem__` and `lookup`, serving rows from its own store.
    Under torch.compile in training, the rows of tables with sparse gradients come from outside the graph
    (`rows_outside_graph`, before the layers; `outside_rows` holds them).
    """

    def __init__(self, tables: "StemTables", stem_input_ids: torch.LongTensor):
        self.tables = tables
        self.stem_input_ids = stem_input_ids
        self._unique = None
        self._unique_here = None
        self._ahead: dict[int, Future[_Fetched] | _Fetched] = {}  # under way on the worker, or fetched at once
        self._served: set[int] = set()
        self._layers: dict[int, nn.Embedding] | None = None
        self._at_once: bool | None = None
        # This forward's part of `fuses`. A compiled train step never fuses: asked, its token count would be a guard.
        compiled_training = torch.is_grad_enabled() and torch.compiler.is_compiling()
        self._fusing = not compiled_training and lookup_fuses(tables.config, stem_input_ids)
        self._device = stem_input_ids.device
        self.outside_rows: dict[int, torch.Tensor] = {}

    def __getitem__(self, layer_idx: int) -> torch.Tensor:
        if layer_idx in self.outside_rows:
            return self.outside_rows[layer_idx]
        module = self.tables[str(layer_idx)]
        if "token_adapter" not in module._modules:  # no call here: a decoding step asks per STEM layer
            return self._rows(layer_idx, module)
        table, trained = self.source(layer_idx)
        rows = self._rows(layer_idx, table)
        return rows if trained is None else with_trained_rows(rows, self.stem_input_ids, trained)

    def source(self, layer_idx: int) -> tuple[nn.Module, StemTrainedRows | None]:
        """The module layer `layer_idx`'s rows come from, and the trained rows put in after them: the table under
        PEFT's trainable tokens with their rows, where `trained_tokens` finds them, else the layer's module and None."""
        module = self.tables[str(layer_idx)]
        trained = trained_tokens(module)
        return (module, None) if trained is None else (trained.table, trained)

    def _rows(self, layer_idx: int, table: nn.Module) -> torch.Tensor:
        weight = table.weight if type(table) is StemTable else base_table(table).weight
        if weight.shape[0] == 0:
            raise RuntimeError(f"STEM table {layer_idx}: {FREED_TABLES}")
        if torch.compiler.is_compiling() and outside_graph(table):  # layers compiled one by one: this layer's alone
            return _rows_outside_graph_of(self, layer_idx)
        if not self.host_served(table):
            settle(weight)
            if torch.is_grad_enabled() and self.distinct_grad(table):  # first: a decoding step's one call
                unique, inverse = self.distinct_here()
                return StemDistinctRowsGrad.apply(weight, self.stem_input_ids, unique, inverse)
            return table(self.stem_input_ids)
        return self.host_rows(layer_idx, table)

    def lookup(self, layer_idx: int) -> torch.Tensor | StemLookup:
        """Layer `layer_idx`'s rows as `self[layer_idx]` gives them or, where the layer gathers them inside its own
        kernel (`fuses`), what to gather from: the table and the ids (with the distinct ids where the table's gradient
        is sparse over them), or the rows moved from host memory and each position's place among them."""
        table = self.tables[str(layer_idx)]
        if "token_adapter" in table._modules:  # PEFT's trainable tokens: the rows, the trained ones put in
            return self[layer_idx]
        if not (self._fusing and self.fuses(table)) or table.weight.shape[0] == 0:  # `_fusing` first: no call
            return self.outside_rows[layer_idx] if layer_idx in self.outside_rows else self._rows(layer_idx, table)
        if not self.host_served(table):
            settle(table.weight)
            if self.distinct_grad(table):
                return StemLookup(table.weight, self.stem_input_ids, *self.distinct_here())
            return StemLookup(table.weight, self.stem_input_ids)
        return self.host_rows(layer_idx, table, gathered=False)

    def fuses(self, table: nn.Embedding) -> bool:
        """Whether the layer gathers `table`'s rows inside its own kernel (`fused_gated_lookup`), as
        `config.fused_table_lookup` says (None: where the ids are on a device `fuses_lookups_on`, for forwards of at
        least `FUSED_LOOKUP_MIN_TOKENS` tokens): a plain table, in inference and eager training (a compiled train step
        takes the model's own graph). The forward's part of that is decided once, as the rows are made: a decoding
        step asks it per STEM layer, and a step's time on a GPU is mostly the launching thread's."""
        if not self._fusing or type(table) is not StemTable:
            return False
        if torch.is_grad_enabled() and torch.compiler.is_compiling():
            return False
        return not (_hooked(table) or not _usual(table) or table.weight.device.type == "meta")

    def distinct_grad(self, table: nn.Embedding) -> bool:
        """Whether a table on the ids' device gets its sparse gradient over the distinct ids (`StemDistinctRowsGrad`):
        a plain `sparse` table that trains, eager. A wrapped or hooked table computes its rows in its own forward (an
        accelerate hook replaces `forward` itself, and brings a meta weight in there); a freed table raises there."""
        if not torch.is_grad_enabled() or type(table) is not StemTable:  # first: inference and decoding stop here
            return False
        if _hooked(table) or table.weight.device.type == "meta" or table.weight.shape[0] == 0:
            return False
        grows = table.weight.requires_grad and table.sparse
        return grows and _usual(table) and not torch.compiler.is_compiling()

    def distinct_here(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward's distinct ids and each position's place among them, on the ids' device: computed once per
        forward, the one host sync of a training step with sparse table gradients."""
        if self._unique_here is None:
            self._unique_here = torch.unique(self.stem_input_ids, return_inverse=True)
        return self._unique_here

    def host_served(self, table: nn.Embedding) -> bool:
        """Whether `table` lives on another device than the ids (meta: an accelerate hook brings the weight)."""
        device = (table.weight if type(table) is StemTable else base_table(table).weight).device
        return device != self._device and device.type != "meta"

    def distinct(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward's distinct ids on the host and, on the ids' device, where each position's row is among them.
        Computed once per forward: the forward's one host sync."""
        if self._unique is None:
            unique, inverse = torch.unique(self.stem_input_ids.cpu(), return_inverse=True)
            self._unique = unique, inverse.to(self.stem_input_ids.device, non_blocking=True)
        return self._unique

    def pipelined(self, table: nn.Embedding) -> bool:
        """Whether the worker serves `table`: a plain table in host memory, for ids on a CUDA device (or on the CPU,
        where tests route a model through this path). Under compile a thread is not traceable; a wrapped table (PEFT's
        trainable tokens) or a hooked one computes its rows in its own forward; a table on another accelerator, or ids
        on one without CUDA streams, are served by the plain lookup."""
        if type(table) is not StemTable or _hooked(table):
            return False
        on_host = table.weight.device.type == "cpu" and self.stem_input_ids.device.type in ("cuda", "cpu")
        return on_host and not torch.compiler.is_compiling()

    def host_rows(self, layer_idx: int, table: nn.Module, gathered: bool = True) -> torch.Tensor | StemLookup:
        """Layer `layer_idx`'s rows from `table`, on another device than the ids: each distinct id looked up once, only
        those rows moved. Where `pipelined`, the worker fetches them ahead, or every such table's rows are fetched at
        once here, on the first ask (`at_once`). Not `gathered`: the moved rows and each position's place among them,
        for the layer to gather."""
        unique, inverse = self.distinct()
        if not self.pipelined(table):
            weight = base_table(table).weight
            settle(weight)
            rows = table(unique.to(weight.device)).to(self.stem_input_ids.device, non_blocking=True)
            return rows[inverse] if gathered else StemLookup(rows, inverse)
        if layer_idx in self._served:  # activation checkpointing recomputes the layer: fetch again, nothing ahead
            rows, ready = self._fetch(table, unique, self._main_stream())
        else:
            if not self.at_once():
                self._fetch_ahead(layer_idx)
            elif layer_idx not in self._ahead:
                self._fetch_at_once()
            fetched = self._ahead.pop(layer_idx)
            rows, ready = fetched.result() if isinstance(fetched, Future) else fetched
            self._served.add(layer_idx)
        if ready is not None:
            torch.cuda.current_stream(rows.device).wait_event(ready)
        if torch.is_grad_enabled() and table.weight.requires_grad:
            rows = StemHostRowsGrad.apply(table.weight, unique, rows, table.sparse)
        return rows[inverse] if gathered else StemLookup(rows, inverse)

    def _main_stream(self):
        device = self.stem_input_ids.device
        return torch.cuda.current_stream(device) if device.type == "cuda" else None

    def start(self) -> None:
        """Starts fetching the host tables' rows before the layers run (the ids are known before any compute): every
        table's at once (`at_once`), or the first STEM layer's and the `HOST_ROWS_AHEAD` after it on the worker, so
        the embedding and the dense layers before the first STEM layer overlap them. Nothing under compile."""
        if torch.compiler.is_compiling() or not self.pipelined_layers():
            return
        if self.at_once():
            self._fetch_at_once()
        else:
            self._fetch_ahead(min(self.pipelined_layers()))

    def at_once(self) -> bool:
        """Whether the `pipelined` tables' rows are fetched at once, on the forward's thread, rather than layer by layer
        ahead by the worker: in inference, for at most `HOST_AT_ONCE_MAX_IDS` distinct ids. Decided once per forward
        (reentrant checkpointing runs a training forward's layers without gradients)."""
        if self._at_once is None:
            self._at_once = not torch.is_grad_enabled() and len(self.distinct()[0]) <= HOST_AT_ONCE_MAX_IDS
        return self._at_once

    def pipelined_layers(self) -> dict[int, nn.Embedding]:
        """The host-table layers whose rows come before their ask (a freed table raises when its layer asks), each
        with the table its rows come from (`source`). Asked outside compiled code only, where `pipelined` holds for the
        whole forward."""
        if self._layers is None:
            served = {
                int(k): t if "token_adapter" not in t._modules else self.source(int(k))[0]
                for k, t in self.tables.items()
            }
            self._layers = {
                layer: t
                for layer, t in served.items()
                if self.host_served(t) and self.pipelined(t) and t.weight.shape[0] != 0
            }
        return self._layers

    def _fetch_ahead(self, layer_idx: int) -> None:
        """Starts the fetches of `layer_idx` and the `HOST_ROWS_AHEAD` host-table layers after it not yet started."""
        unique, _ = self.distinct()
        main = self._main_stream()  # read in this thread: the worker's current stream is another
        for layer in layers_ahead(self.pipelined_layers(), layer_idx, (self._ahead, self._served)):
            self._ahead[layer] = _row_worker().submit(self._fetch, self.pipelined_layers()[layer], unique, main)

    def _fetch_at_once(self) -> None:
        """Fetches the rows of every `pipelined` host table not yet fetched, here: each table gathered into its slice
        of one pinned buffer per dtype, whose copy runs on the side stream (one copy, one event)."""
        unique, _ = self.distinct()
        groups: dict[tuple[torch.dtype, torch.Size], list[int]] = {}
        for layer, table in self.pipelined_layers().items():
            if layer not in self._ahead and layer not in self._served:
                weight = table.weight
                groups.setdefault((weight.dtype, weight.shape[1:]), []).append(layer)
        pinned = self.stem_input_ids.device.type == "cuda"
        for (dtype, row), layers in groups.items():
            staged = torch.empty((len(layers), len(unique), *row), dtype=dtype, pin_memory=pinned)
            for at, layer in enumerate(layers):
                weight = self.pipelined_layers()[layer].weight
                settle(weight)
                gather_rows(weight.detach(), unique, out=staged[at])
            rows, ready = copy_staged(staged, self.stem_input_ids.device, self._main_stream())
            self._ahead.update({layer: (rows[at], ready) for at, layer in enumerate(layers)})

    def _fetch(self, table: nn.Embedding, unique: torch.Tensor, main) -> _Fetched:
        """The rows of `unique` on the ids' device, and the event that marks their copy done (CUDA only)."""
        settle(table.weight)  # on the worker: the layers before go on while a write behind finishes
        return fetch_rows(table.weight.detach(), unique, self.stem_input_ids.device, main)


def layers_ahead(layers: Iterable[int], layer_idx: int, started: tuple[Container[int], ...]) -> list[int]:
    """Of `layers`, `layer_idx` and the `HOST_ROWS_AHEAD` after it, less those in any of `started`: the fetches to
    start when `layer_idx` asks for its rows."""
    upcoming = sorted(layer for layer in layers if layer >= layer_idx)[: 1 + HOST_ROWS_AHEAD]
    return [layer for layer in upcoming if not any(layer in done for done in started)]


def fetch_rows(
    source: torch.Tensor, unique: torch.Tensor, device: torch.device, main: "torch.cuda.Stream | None"
) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """The rows of host ids `unique` of host tensor `source` on `device`, and the event that marks their copy done
    (CUDA only): gathered into pinned memory, whose copy runs on a side stream while `main` (the stream that will read
    them) computes. What a worker thread runs ahead of the layers (`StemTableRows`, the offload engine)."""
    staged = torch.empty((len(unique), *source.shape[1:]), dtype=source.dtype, pin_memory=device.type == "cuda")
    gather_rows(source, unique, out=staged)
    return copy_staged(staged, device, main)


def copy_staged(
    staged: torch.Tensor, device: torch.device, main: "torch.cuda.Stream | None"
) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """Host tensor `staged` (pinned, for a CUDA `device`) on `device`, and the event that marks its copy done (CUDA
    only): copied on a side stream, kept alive until `main`, the stream that reads it, is done with it."""
    if device.type != "cuda":
        return staged.to(device), None
    stream = _side_stream(_COPY_STREAMS, device)
    with torch.cuda.stream(stream):
        rows = staged.to(device, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(stream)
    rows.record_stream(main)  # made on the side stream, read on the main one
    return rows, ready


# What dynamo says where it cannot leave a lookup out of the graph: under `fullgraph=True`. `reason` is torch 2.7's.
_OUTSIDE_GRAPH = (
    "STEM tables with sparse gradients (sparse=True, trainable) are looked up outside the compiled graph, which "
    "fullgraph=True forbids: compile without fullgraph, or give the tables dense gradients "
    "(stem_hf.training.use_sparse_table_grads(model, enable=False); StemTrainer(..., sparse_table_grads=False))"
)
_DISABLE = {"reason": _OUTSIDE_GRAPH} if "reason" in inspect.signature(torch.compiler.disable).parameters else {}


def outside_graph(table: nn.Module) -> bool:
    """Whether, under torch.compile in training, `table`'s rows are gathered outside the graph
    (`rows_outside_graph`): a table whose gradient is sparse (`sparse=True`) and that trains, which a compiled backward
    cannot make (inductor takes dense tensors only)."""
    weight = getattr(table, "weight", None)
    if not (torch.is_grad_enabled() and getattr(table, "sparse", False) and isinstance(weight, torch.Tensor)):
        return False
    return weight.requires_grad and weight.device.type != "meta" and weight.shape[0] != 0


@torch.compiler.disable(**_DISABLE)
def rows_outside_graph(
    tables: "StemTables", stem_input_ids: torch.LongTensor, layers: tuple[int, ...]
) -> list[torch.Tensor]:
    """Layers `layers`' rows of `stem_input_ids`, by the eager path (`StemTableRows` outside any compile: sparse
    gradients over the distinct rows, host tables fetched ahead), for compiled code to take as inputs. In the tables'
    dtype: each layer casts its rows, as in eager."""
    rows = StemTableRows(tables, stem_input_ids)
    return [rows[layer] for layer in layers]


@torch.compiler.disable(**_DISABLE)
def _rows_outside_graph_of(rows: StemTableRows, layer_idx: int) -> torch.Tensor:
    """Layer `layer_idx`'s table rows by the eager path, from a layer compiled on its own: the forward's distinct ids
    and fetches ahead serve every layer, as in eager (trained rows are put in by the caller)."""
    return rows._rows(layer_idx, rows.source(layer_idx)[0])


class StemSoftPromptRows:
    """Rows for inputs whose first `num_soft` positions are soft prompts (embeddings with no token, as PEFT prompt
    tuning prepends): those positions get a zero row, so a STEM layer's FFN adds nothing there."""

    def __init__(self, rows, num_soft: int):
        self.rows = rows
        self.num_soft = num_soft

    def __getitem__(self, layer_idx: int) -> torch.Tensor:
        return nn.functional.pad(self.rows[layer_idx], (0, 0, self.num_soft, 0))


_OPTIMIZER_HOOK = None  # the handle of `_check_optimizer`, registered at most once per process


def _on_accelerator(param: torch.Tensor) -> bool:
    return param.device.type not in ("cpu", "meta")


def _check_optimizer(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook (process-wide, added once a table or PEFT's trained rows of one train). Casts their
    optimizer state to their dtype: a resumed `Trainer` loads the state before `train()` upcasts them, so torch cast it
    to bf16. Warns once per optimizer that decays a table, or PEFT's trained rows of one: a plain `Trainer` decays every
    parameter but norms and biases, and decoupled decay shrinks every row at each step, its token in the batch or
    not; no model-side setting reaches Trainer's groups. A group marked `decay_tables=True` decays them on purpose
    (the paper's recipe): no warning. Warns once per optimizer that steps host tables with dense gradients for a model
    elsewhere (a plain `Trainer`)."""
    tables = getattr(optimizer, "_stem_tables", None)
    if tables is None:
        tables = optimizer._stem_tables = [
            (group, p)
            for group in optimizer.param_groups
            for p in group["params"]
            if getattr(p, "_stem_table", False) or getattr(p, "_stem_trained_rows", False)
        ]
        decayed = [g for g, _ in tables if g.get("weight_decay") and not g.get("decay_tables")]
        decayed = decayed[0] if decayed else None
        if decayed is not None:
            logger.warning(
                f"{type(optimizer).__name__} applies weight_decay={decayed['weight_decay']} to STEM tables (or to the "
                "rows PEFT trains of them): every row shrinks at each step, its token in the batch or not. Put the "
                "tables in a group with weight_decay=0 (stem_hf.training.param_groups), or train with "
                "stem_hf.training.StemTrainer, which does"
            )
        # The plain Trainer path over host tables: correct, and slow. The paper's recipe is dense on purpose.
        host = [
            p
            for g, p in tables
            if getattr(p, "_stem_table", False)
            and p.device.type == "cpu"
            and p.grad is not None
            and not p.grad.is_sparse
            and not g.get("decay_tables")
        ]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if host and any(p.grad is not None and _on_accelerator(p) for p in params):
            gib = sum(p.numel() * p.grad.element_size() for p in host) / 2**30
            logger.warning(
                f"{type(optimizer).__name__} steps STEM tables in host memory with dense gradients: every backward "
                f"builds [vocab, d_ff] gradients on the host ({gib:.2f} GiB) and every step reads all of them, however "
                "few rows the batch holds. Sparse table gradients (stem_hf.training.StemTrainer's default recipe) "
                "give the batch's rows only and update those rows only"
            )
    if getattr(optimizer, "write_behind", False):  # stem_hf's RowSparseAdamW: waits for all its writes, raises once
        optimizer.settle()
    for _, param in tables:
        settle(param)  # its state may still be written behind
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

    Trainable tables train in float32: `train()` casts them in memory (`upcast_trainable`; set `upcast_for_training`
    to False to keep them as stored), and a save then writes float32 tables unless told otherwise
    (`save_pretrained(..., table_dtype=...)`). A bf16 value moves only by steps of 1/256 of its size: fine-tuning
    updates would round away in training and again at save time. The config is never changed by training.
    """

    upcast_for_training: bool = True

    def __init__(self, config: StemConfig):
        dtype = config.torch_table_dtype
        super().__init__(
            {str(i): StemTable(config.vocab_size, config.intermediate_size, dtype=dtype) for i in config.stem_layers}
        )
        self.config = config

    def forward(self, stem_input_ids: torch.LongTensor) -> StemTableRows:
        # Under PEFT's trainable tokens, the tables themselves: a read of the wrapper's `weight` copies the whole table.
        parts = [_trained_parts(t) for t in self.values()] if torch.is_grad_enabled() else []
        tables = [table for table, *_ in parts]  # the first part: the table itself
        if self.training and parts:
            weights = [w for each in parts for part in each for w in part.parameters()]
            low = {str(w.dtype)[6:] for w in weights if w.requires_grad and w.dtype != torch.float32}
            if low:
                logger.warning_once(
                    f"training STEM tables in {', '.join(sorted(low))}: updates smaller than 1/256 of a value are lost "
                    "to rounding. Call model.base_model.stem_tables.upcast_trainable() before wrapping the model for "
                    "DDP/FSDP (train() does it when torch.distributed is not initialized) to train them in float32"
                )
        rows = StemTableRows(self, stem_input_ids)
        if any(not rows.host_served(t) and rows.distinct_grad(t) for t in tables):
            rows.distinct_here()  # now, while the id check has just emptied the queue: its sync waits for little
        return rows

    def train(self, mode: bool = True) -> "StemTables":
        super().train(mode)
        if mode:
            trainable = [w for w in (base_table(t).weight for t in self.values()) if w.requires_grad]
            for weight in trainable:
                weight._stem_table = True  # lets `_check_optimizer` tell tables from other matrices
                weight.stem_reads_wait = True  # this file's reads of it wait for a write behind: one may be made
            # PEFT's trained rows (trainable tokens) decay as a table would: `_check_optimizer` names that too
            rows = [w for t in self.values() for part in _trained_parts(t)[1:] for w in part.parameters()]
            for weight in rows:
                weight._stem_trained_rows = True
            global _OPTIMIZER_HOOK
            if (trainable or rows) and _OPTIMIZER_HOOK is None:
                _OPTIMIZER_HOOK = register_optimizer_step_pre_hook(_check_optimizer)
            # A model wrapped for DDP/FSDP cannot change a parameter's dtype: there, upcast_trainable() is the
            # caller's, before wrapping, and the forward warns.
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
            if self.upcast_for_training and not distributed:
                self.upcast_trainable()
        return self

    def upcast_trainable(self) -> list[str]:
        """Casts the tables that require grad to float32 in memory (a memory-mapped table's file is left as it is) and
        returns their layer keys; `config.table_dtype` is left as it is. Under PEFT's trainable tokens, the trained
        rows (the table PEFT freezes stays as it is). Sharded (DTensor) tables are left as they are."""
        casts = {
            key: [part for part in _trained_parts(t) if any(map(_upcasts, part.parameters()))]
            for key, t in self.items()
        }
        casts = {key: parts for key, parts in casts.items() if parts}
        if not casts:
            return []
        stored = self.config.table_dtype
        for parts in casts.values():
            for part in parts:
                part.to(torch.float32)  # the module's own cast: StemTables._apply would refuse it
        numel = sum(w.numel() for parts in casts.values() for part in parts for w in part.parameters())
        keys = list(casts)
        if not any(isinstance(part, StemTable) for parts in casts.values() for part in parts):
            logger.warning_once(f"The rows PEFT trains of STEM tables {keys} train in float32: cast in memory")
            return keys
        logger.warning_once(
            f"STEM tables {keys} train in float32: cast from {stored} in memory ({numel * 4 / 2**30:.2f} GiB), and "
            "saves write them in float32 (save_pretrained(..., table_dtype='bfloat16') rounds them). Freeze them "
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

    @property
    def freed(self) -> bool:
        """Whether `StemOffloadEngine(free_tables=True)` dropped the tables (they then hold no rows)."""
        return any(base_table(table).weight.shape[0] == 0 for table in self.values())

    def check_not_freed(self, what: str) -> None:
        """Raises, naming `what`, where an offload engine freed the tables."""
        if self.freed:
            raise RuntimeError(f"{what}: {FREED_TABLES}")

    @torch.no_grad()
    def resize(self, new_num_tokens: int, mean_resizing: bool = True) -> None:
        """Gives every table `new_num_tokens` rows. Kept rows are copied; new rows are the mean of the old rows
        (`mean_resizing=True`: the table's best guess for a token it knows nothing about) or drawn from the paper's
        xavier-normal init (`mean_resizing=False`)."""
        self.check_not_freed("resize_token_embeddings")
        for key, old in list(self.items()):
            settle(old.weight)
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
        self.fuses = config.hidden_act == "silu"  # the activation `fused_gated_lookup` computes

    def forward(self, x: torch.Tensor, rows: torch.Tensor | StemLookup) -> torch.Tensor:
        gate = self.gate_proj(x)
        if isinstance(rows, StemLookup):
            if self.fuses and rows.table.device == x.device:
                return self.down_proj(fused_gated_lookup(gate, rows))
            rows = gathered(rows)
        # Cast the gathered rows, never the table: tables may be stored in another dtype or live on another device.
        rows = rows.to(device=x.device, dtype=x.dtype)
        return self.down_proj(self.act_fn(gate) * rows)


class StemRows(Protocol):
    """One forward's table rows: `rows[layer_idx]` is STEM layer `layer_idx`'s rows for the forward's table ids, shaped
    `(*stem_input_ids.shape, intermediate_size)`, on any device and in any dtype (the layer casts them). Rows may also
    offer `lookup(layer_idx)`: the same rows, or a `StemLookup` for the layer to gather inside its own kernel
    (`StemTableRows.lookup`), which the model's own STEM MLP asks for instead."""

    def __getitem__(self, layer_idx: int) -> torch.Tensor: ...


class StemRowSource(Protocol):
    """Where a forward's table rows come from: called once per forward with its table ids. The model's `StemTables` is
    the default source; `StemModel.set_row_source` plugs in another (the offload engine serves rows from a host store,
    the knowledge editor serves other tokens' rows)."""

    def __call__(self, stem_input_ids: torch.LongTensor) -> StemRows: ...


class StemDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: StemConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_stem = layer_idx in config.stem_layers
        self.self_attn = StemAttention(config=config, layer_idx=layer_idx)
        self.mlp = StemTableMLP(config) if self.is_stem else StemMLP(config)
        self.input_layernorm = StemRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = StemRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @takes_cache  # GradientCheckpointingLayer drops the cache by the name transformers gives it
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        stem_rows: StemRows | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        if self.is_stem:
            # The model's own rows may be gathered inside the MLP's kernel (`StemTableRows.lookup`), where the MLP is
            # this file's and nothing hooks it: a replaced MLP (healing's blend) or a hook reading it wants rows.
            mlp = self.mlp
            own = type(mlp) is StemTableMLP and not _hooked(mlp) and callable(getattr(type(stem_rows), "lookup", None))
            hidden_states = mlp(hidden_states, stem_rows.lookup(self.layer_idx) if own else stem_rows[self.layer_idx])
        else:
            hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


# The models whose forwards skip the id check here (`StemModel.ids_checked`): per thread and task.
_IDS_CHECKED: ContextVar[frozenset[int]] = ContextVar("stem_hf_ids_checked", default=frozenset())


def check_token_ids(ids: torch.Tensor, vocab_size: int, name: str) -> None:
    """Raises if `ids` holds an id outside `[0, vocab_size)`. On a GPU an out-of-range gather is a device-side assert
    that kills the process, so the check runs before any lookup: one host sync, once per user input."""
    if ids.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(ids)).tolist()
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{name} holds token id {bad}, outside [0, {vocab_size}): vocab_size is {vocab_size}")


def capturing_graph(tensor: torch.Tensor) -> bool:
    """Whether the forward that `tensor` enters is being captured into a CUDA graph (continuous batching, as in
    `generate_batch`, captures forwards): the graph's replays run none of its Python. Never asked while dynamo traces,
    where the query would end the graph (it returns a Python bool)."""
    if torch.compiler.is_compiling() or not captures_graphs(tensor.device):
        return False
    return torch.cuda.is_current_stream_capturing()


def captures_graphs(device: torch.device) -> bool:
    """Whether a forward on `device` may be captured into a graph that `capturing_graph` sees: CUDA's."""
    return device.type == "cuda"


def refuse_graph_capture(tables: "StemTables", ids: torch.Tensor, source: StemRowSource | None) -> None:
    """Raises, before anything syncs, where a forward of `ids` being captured into a CUDA graph would read table rows
    from another device than the ids' (host memory) or from a row source (an offload engine): the host's part of that
    is Python, which the graph's replays would skip, serving the captured batch's rows to every later one."""
    devices = {key: base_table(table).weight.device for key, table in tables.items()}
    elsewhere = [key for key, device in devices.items() if device != ids.device and device.type != "meta"]
    if source is None and not elsewhere:
        return
    where = f"a row source ({type(source).__name__})"
    if source is None:
        where = f"STEM tables {elsewhere} on another device than the ids (host memory)"
    raise RuntimeError(
        f"this forward is being captured into a CUDA graph, whose replays run no Python, but its rows come from "
        f"{where}, which needs the host at every forward. Keep the tables on the GPU (keep_tables_on_cpu=False), or "
        "run continuous batching without CUDA graphs: ContinuousBatchingConfig(use_cuda_graph=False)"
    )


class StemPreTrainedModel(PreTrainedModel):
    config: StemConfig
    config_class = StemConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["StemDecoderLayer"]
    _skip_keys_device_placement = list(CACHE_ARGS)
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True  # resident tables; tests/test_compile.py
    _can_record_outputs = {"hidden_states": StemDecoderLayer, "attentions": StemAttention}
    # Set by the stem_hf package (card template, Hub code): without it, no card, and pushes as transformers does.
    _model_card_writer: Callable | None = None
    _hub_pusher: Callable | None = None

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, StemTable):  # the paper's xavier-normal init over the [vocab, d_ff] table
            init.normal_(module.weight, mean=0.0, std=xavier_normal_std(*module.weight.shape))
        else:
            super()._init_weights(module)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`PreTrainedModel.from_pretrained`, files checked and read as one save (`checkpoint_stem.load_checkpoint`);
        tables stay in host memory under a `device_map`, memory-mapped when stored in `table_dtype`."""
        return load_checkpoint(cls, super().from_pretrained, pretrained_model_name_or_path, *model_args, **kwargs)

    def save_pretrained(
        self, save_directory, is_main_process=True, state_dict=None, table_dtype=None, **kwargs
    ) -> None:
        """Staged, atomic; tables in own shards, in `table_dtype` or as held (`checkpoint_stem.save_checkpoint`)."""
        if getattr(self, "_hf_peft_config_loaded", False) or not self.should_save_on_this_rank(is_main_process):
            return super().save_pretrained(save_directory, is_main_process, state_dict, **kwargs)
        save_checkpoint(self, save_directory, super().save_pretrained, state_dict, table_dtype=table_dtype, **kwargs)

    def push_to_hub(self, repo_id: str, **kwargs) -> str:
        """Uploads what `save_pretrained` writes, with card and provenance when stem_hf is installed (`push_model`)."""
        if self._hub_pusher is None:
            return super().push_to_hub(repo_id, **kwargs)
        return self._hub_pusher(self, repo_id, **kwargs)

    def train(self, mode: bool = True) -> "StemPreTrainedModel":
        if mode:  # a model in training stops vouching for the checkpoint it was loaded from
            self.stem_save_id = unsaved_id()
        return super().train(mode)

    def set_table_dtype(self, dtype: torch.dtype | str) -> None:
        """Casts every table to `dtype` and records it in `config.table_dtype` (what new tables and loads use)."""
        self.config.table_dtype = check_table_dtype(str(dtype).removeprefix("torch."))
        for table in self.base_model.stem_tables.values():
            table.to(self.config.torch_table_dtype)

    def resize_token_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True) -> nn.Embedding:
        """Also resizes every STEM table (refused if freed or PEFT-wrapped); new rows: the old ones' mean or xavier."""
        unwrapped_tables(self, "resize_token_embeddings").check_not_freed("resize_token_embeddings")
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        self.base_model.stem_tables.resize(embeddings.num_embeddings, mean_resizing)
        return embeddings


class StemModel(StemPreTrainedModel):
    def __init__(self, config: StemConfig):
        super().__init__(config)
        if config.stem_layers and max(config.stem_layers) >= config.num_hidden_layers:  # num_hidden_layers set after
            raise ValueError(f"stem_layers {config.stem_layers}: no such layer in {config.num_hidden_layers} layers")
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [StemDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.stem_tables = StemTables(config)
        self.row_source: StemRowSource | None = None  # None: `stem_tables`; see `set_row_source`
        # Left out of device maps on purpose (`checkpoint_stem.device_map_keeping_tables_on_cpu`); a non-None value
        # makes transformers skip accelerate's check that every parameter has a device.
        self._no_placement_params = [f"stem_tables.{i}.weight" for i in config.stem_layers]
        self.norm = StemRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = StemRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    @contextmanager
    def ids_checked(self) -> Iterator[None]:
        """This model's forwards inside skip the token-id check and its host sync: `generate` checks the prompt and
        the pad id once, and every other id it feeds back is one the model chose from its vocabulary. Per thread
        and task (a context variable): a `generate` never unchecks another thread's forwards."""
        token = _IDS_CHECKED.set(_IDS_CHECKED.get() | {id(self)})
        try:
            yield
        finally:
            _IDS_CHECKED.reset(token)

    def set_row_source(self, source: StemRowSource | None) -> StemRowSource | None:
        """Serves the table rows of later forwards from `source` (None: this model's tables). Returns the source it
        replaces, for the caller to restore: sources stack, the last set being the first restored."""
        previous = self.row_source
        self.__dict__["row_source"] = source  # never registered as a submodule: it is not part of the model
        return previous

    def _layers_compiled(self) -> bool:
        """Whether decoder layers are compiled one by one (`layer.compile()`, or `torch.compile` of each, as
        accelerate's regional compilation does): their lookups are traced, and rows fetched before them would go
        unread."""
        # `_modules` first: a `hasattr` miss raises and catches an AttributeError. A wrapper (activation checkpointing,
        # FSDP1) forwards attributes to a compiled layer inside it: asked by name.
        return any(getattr(layer, "_compiled_call_impl", None) is not None or "_orig_mod" in layer._modules
                   or (type(layer) is not StemDecoderLayer and hasattr(layer, "_orig_mod"))
                   for layer in self.layers)  # fmt: skip

    def stem_rows(
        self, stem_input_ids: torch.LongTensor | None, inputs_embeds: torch.Tensor, soft_allowed: bool, capturing: bool
    ) -> StemRows:
        """This forward's table rows for `stem_input_ids`, from the row source. `soft_allowed`: the inputs are
        embeddings, whose first positions may be soft prompts without a token. `capturing`: the forward is being
        captured into a CUDA graph (`capturing_graph`)."""
        if stem_input_ids is None:
            raise ValueError(
                f"this model has STEM layers {self.config.stem_layers}, whose tables are indexed by token ids: "
                "pass `stem_input_ids` (batch_size, sequence_length) along with `inputs_embeds` (with PEFT prompt "
                "tuning, pass the text's input ids as `stem_input_ids`)"
            )
        batch, length = inputs_embeds.shape[:2]
        # Embeddings may start with soft prompts (PEFT prompt tuning): then the ids cover the positions after them.
        num_soft = length - stem_input_ids.shape[-1]
        soft_allowed = soft_allowed and 0 <= num_soft < length
        if stem_input_ids.ndim != 2 or stem_input_ids.shape[0] != batch or not (num_soft == 0 or soft_allowed):
            raise ValueError(
                f"stem_input_ids has shape {tuple(stem_input_ids.shape)} but the inputs have (batch_size, "
                f"sequence_length) = {(batch, length)}: give one table id per input position (with "
                "`inputs_embeds`, fewer ids mean that the first positions are soft prompts without a token)"
            )
        outside = {}
        if self.row_source is None and torch.compiler.is_compiling():
            # One graph break per forward, here: never one inside the layers' loop, which dynamo would run eager. Before
            # the rows object is built: dynamo cannot hand an object it built in the graph to a call out of it.
            layers = tuple(int(key) for key, table in self.stem_tables.items() if outside_graph(base_table(table)))
            if layers:
                outside = dict(zip(layers, rows_outside_graph(self.stem_tables, stem_input_ids, layers), strict=True))
        if capturing:
            refuse_graph_capture(self.stem_tables, stem_input_ids, self.row_source)
        stem_rows = (self.stem_tables if self.row_source is None else self.row_source)(stem_input_ids)
        if self.row_source is None and not torch.compiler.is_compiling():
            # The ids are known before any layer runs; `_layers_compiled` asked last, of host tables only.
            if stem_rows.pipelined_layers() and not self._layers_compiled():
                stem_rows.start()
        if outside:
            stem_rows.outside_rows.update(outside)
        if num_soft:
            stem_rows = StemSoftPromptRows(stem_rows, num_soft)
        return stem_rows

    @takes_cache
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
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
        check_model_kwargs(type(self).__name__, kwargs)
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        given = "input_ids" if input_ids is not None else "inputs_embeds"
        inputs = input_ids if input_ids is not None else inputs_embeds
        if inputs.shape[1:2] == (0,):
            raise ValueError(f"{given} has shape {tuple(inputs.shape)}: no position to run; give at least one token")
        # Under torch.compile a check would be a graph break or a sync in the graph: compiled callers check their ids
        # (generate does, once per prompt). A CUDA graph's capture cannot sync at all, and its replays run no Python:
        # there, as in Llama, ids go unchecked.
        capturing = capturing_graph(inputs)  # asked once per forward: the id check and the rows' source need it
        checking = not torch.compiler.is_compiling() and id(self) not in _IDS_CHECKED.get() and not capturing
        if input_ids is not None and checking:
            check_token_ids(input_ids, self.config.vocab_size, "input_ids")
        if stem_input_ids is None:
            stem_input_ids = input_ids
        elif stem_input_ids is not input_ids and checking:
            check_token_ids(stem_input_ids, self.config.vocab_size, "stem_input_ids")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        stem_rows = None
        if self.config.stem_layers:
            stem_rows = self.stem_rows(stem_input_ids, inputs_embeds, input_ids is None, capturing)

        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)

        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{CACHE_ARG: cache},
        )

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                use_cache=use_cache,
                stem_rows=stem_rows,
                **{CACHE_ARG: cache},
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_ARG: cache})


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
        later lookup. With `inputs_embeds` on a model with STEM layers, `stem_input_ids` is required. Token ids (the
        prompt's, `stem_input_ids`, the pad id fed back) are checked here, once, not by each step's forward. A cache of
        the caller's goes by either name (`cache` or `past_key_values`) under every supported transformers."""
        kwargs = rename_cache(kwargs, CACHE_ARG, "generate")
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
            shorter = stem_input_ids.shape[0] == prompt.shape[0] and stem_input_ids.shape[1] < prompt.shape[1]
            if not (assisting and shorter):
                raise ValueError(
                    f"stem_input_ids has shape {tuple(stem_input_ids.shape)} but the prompt has (batch_size, length) "
                    f"= {tuple(prompt.shape[:2])}: give one table id per prompt position"
                )
        for name, given in (("input_ids", ids), ("stem_input_ids", stem_input_ids), *self._fed_back_ids(kwargs)):
            if isinstance(given, torch.Tensor) and not given.is_floating_point():
                check_token_ids(given, self.config.vocab_size, name)
        with self.model.ids_checked():  # the prompt's ids, once; the steps feed back the model's own choices
            return super().generate(inputs, *args, **kwargs)

    def _fed_back_ids(self, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
        """The id `generate` feeds back for finished sequences, which the model did not choose: `pad_token_id`, or
        the first `eos_token_id` where there is none."""
        config = kwargs.get("generation_config") or self.generation_config
        pad = kwargs.get("pad_token_id", getattr(config, "pad_token_id", None))
        name = "pad_token_id"
        if pad is None:
            pad, name = kwargs.get("eos_token_id", getattr(config, "eos_token_id", None)), "eos_token_id"
        pad = pad[0] if isinstance(pad, (list, tuple)) and pad else pad
        return [] if not isinstance(pad, int) else [(f"generate's {name}", torch.tensor([pad]))]

    @takes_cache
    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        stem_input_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> dict:
        """Lets `generate` take `stem_input_ids` for the prompt (and `inputs_embeds` with them): the tokens it generates
        look up their own rows. The step's ids always travel as `stem_input_ids`, so that a wrapper that swaps
        `input_ids` for embeddings (PEFT prompt tuning) still sends the tables their ids."""
        model_inputs = super().prepare_inputs_for_generation(
            input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **{CACHE_ARG: cache}, **kwargs
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
            start = cache.get_seq_length() if cache is not None else 0
            model_inputs["stem_input_ids"] = stem_input_ids[:, start : start + step.shape[1]]
            return model_inputs
        # With a prompt given as embeddings, input_ids holds only the generated tokens.
        generated = input_ids if inputs_embeds is not None else input_ids[:, stem_input_ids.shape[1] :]
        full = torch.cat([stem_input_ids, generated], dim=1)
        model_inputs["stem_input_ids"] = full[:, full.shape[1] - step.shape[1] :]
        return model_inputs

    @takes_cache
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
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
            cache=cache,
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
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{CACHE_ARG: getattr(outputs, CACHE_ARG)},
        )


__all__ = [
    "FUSED_LOOKUP_MIN_TOKENS",
    "HOST_AT_ONCE_MAX_IDS",
    "HOST_ROWS_AHEAD",
    "INDEX_SELECT_GRAIN",
    "StemDistinctRowsGrad",
    "StemForCausalLM",
    "StemGatedLookup",
    "StemHostRowsGrad",
    "StemLookup",
    "StemModel",
    "StemPreTrainedModel",
    "StemRowSource",
    "StemRows",
    "StemSoftPromptRows",
    "StemTable",
    "StemTableRows",
    "StemTables",
    "StemTrainedRows",
    "base_table",
    "captures_graphs",
    "capturing_graph",
    "check_token_ids",
    "copies_grad_behind",
    "copy_staged",
    "distinct_rows_grad",
    "distinct_sparse_grad",
    "fetch_rows",
    "fused_gated_lookup",
    "fuses_lookups_on",
    "gated_lookup",
    "gated_lookup_grads",
    "gather_rows",
    "gathered",
    "layers_ahead",
    "lookup_fuses",
    "outside_graph",
    "refuse_graph_capture",
    "row_pieces",
    "rows_dynamic",
    "rows_outside_graph",
    "settle",
    "trained_index",
    "trained_tokens",
    "unwrapped_tables",
    "with_trained_rows",
    "xavier_normal_std",
]
