"""STEM model configuration.

Copied next to the weights by `save_pretrained`: imports nothing beyond torch and transformers.
"""

import math
from collections.abc import Callable, Sequence

import torch
from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

from .compat_stem import CACHE_ARG, SUPPORTED_TRANSFORMERS

STEM_RATIOS = ("1/3", "1/2", "full")
TABLE_DTYPES = ("bfloat16", "float16", "float32")


def check_table_dtype(name: str) -> str:
    if name not in TABLE_DTYPES:
        raise ValueError(f"table_dtype: {name!r} is not one of {', '.join(TABLE_DTYPES)}")
    return name


_ALLOWED_STEM_LAYERS = (
    'a list of distinct layer indices, a comma-separated string of them ("1,4,7"), '
    '"" or "none" for no STEM layer, or a ratio: "full" (every layer but 0) or "1/N" for an integer N >= 2 '
    '(the paper uses "1/3" and "1/2")'
)


def resolve_stem_layers(spec: str | Sequence[int] | None, num_hidden_layers: int) -> list[int]:
    """Turns a STEM layer spec into the sorted explicit list of layer indices that the config stores.

    Ratios follow the paper: evenly spaced with stride N starting at layer 1, never layer 0, so `"1/3"` of 16 layers is
    `[1, 4, 7, 10, 13]` and `"1/2"` is the odd layers. `"full"` is every layer but 0. An explicit list may name layer 0.
    """
    if spec is None:
        return []
    if not isinstance(spec, (str, Sequence)):
        raise ValueError(
            f"stem_layers: {spec!r} is neither a list nor a string; allowed values are {_ALLOWED_STEM_LAYERS} "
            f"(for the single layer {spec!r}, write [{spec!r}])"
        )
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text in ("", "none"):
            return []
        if text == "full":
            return list(range(1, num_hidden_layers))
        if "/" in text:
            stride = text[2:] if text.startswith("1/") else ""
            if not stride.isdigit() or int(stride) < 2:
                raise ValueError(f"stem_layers: unknown ratio {spec!r}; allowed values are {_ALLOWED_STEM_LAYERS}")
            return list(range(1, num_hidden_layers, int(stride)))
        try:
            layers = [int(part) for part in text.split(",")]
        except ValueError:
            raise ValueError(f"stem_layers: cannot read {spec!r}; allowed values are {_ALLOWED_STEM_LAYERS}") from None
    else:
        layers = list(spec)
        if any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
            raise ValueError(f"stem_layers: {spec!r} holds a non-integer; allowed values are {_ALLOWED_STEM_LAYERS}")
    out_of_range = [i for i in layers if not 0 <= i < num_hidden_layers]
    if out_of_range:
        raise ValueError(
            f"stem_layers: layer index {out_of_range[0]} is out of range; "
            f"allowed indices are 0..{num_hidden_layers - 1} "
            f"(num_hidden_layers={num_hidden_layers})"
        )
    duplicates = sorted({i for i in layers if layers.count(i) > 1})
    if duplicates:
        raise ValueError(
            f"stem_layers: layer index {duplicates[0]} is listed more than once; each layer may appear once"
        )
    return sorted(layers)


_POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
# Sizes past this overflow the products of sizes that tensors and FLOP counts take (vocab x d_ff, positions x heads).
_MAX_SIZE = 2**31 - 1
# Rope fields that scale or divide: a zero or negative one gives NaN or inf angles.
_POSITIVE_ROPE = ("rope_theta", "factor", "original_max_position_embeddings", "attention_factor")


def _check_number(name: str, value, allowed: Callable[[float], bool], must: str) -> None:
    """Raises unless `value` is a finite real number that `allowed` accepts."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or not allowed(value):
        raise ValueError(f"{name}: {value!r} must be {must}")


def _check_rope(parameters, name: str = "rope_parameters") -> None:
    """Every number in the rope parameters finite, and the ones that scale or divide positive."""
    for key, value in (parameters or {}).items():
        if isinstance(value, dict):  # per layer type
            _check_rope(value, f"{name}[{key!r}]")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value) or (key in _POSITIVE_ROPE and value <= 0):
                must = "a positive finite number" if key in _POSITIVE_ROPE else "finite"
                raise ValueError(f"{name}[{key!r}]: {value!r} must be {must}")


def _check_sizes(config) -> None:
    for name in _POSITIVE_INTS:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: {value!r} must be a positive integer")
        if value > _MAX_SIZE:
            raise ValueError(f"{name}: {value} is larger than the largest size a STEM model takes ({_MAX_SIZE})")
    if config.num_attention_heads % config.num_key_value_heads != 0:
        raise ValueError(
            f"num_attention_heads ({config.num_attention_heads}) must be a multiple of num_key_value_heads "
            f"({config.num_key_value_heads})"
        )


def _check_numbers(config) -> None:
    _check_number("rms_norm_eps", config.rms_norm_eps, lambda x: x > 0, "a positive finite number")
    _check_number("initializer_range", config.initializer_range, lambda x: x >= 0, "a finite number >= 0")
    _check_number("attention_dropout", config.attention_dropout or 0.0, lambda x: 0 <= x < 1, "a probability in [0, 1)")
    if config.hidden_act not in ACT2FN:
        raise ValueError(f"hidden_act: {config.hidden_act!r} is not an activation transformers knows (e.g. 'silu')")


class StemConfig(PreTrainedConfig):
    r"""Configuration of a STEM model: a Llama-family decoder whose FFN up-projection is replaced, in the layers
    listed in `stem_layers`, by a per-layer `[vocab_size, intermediate_size]` table indexed by the input token id.

    Args:
        stem_layers: the layers whose up-projection is a table. Accepts an explicit list, a comma-separated string, or
            a ratio (`"1/3"`, `"1/2"`, `"full"`, any `"1/N"`); it is always resolved to, and saved as, an explicit
            sorted list.
        qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3-style checkpoints).
        attention_out_bias: bias on the attention output projection; `None` follows `attention_bias` (Llama, Qwen3).
            Qwen2 has biases on q, k and v only: `attention_bias=True, attention_out_bias=False`.
        table_dtype: the dtype tables are created, loaded and served in (`"bfloat16"`, `"float16"` or `"float32"`).
            Loading makes no copy of a table stored in this dtype, and model-wide casts (`model.half()`) leave tables
            alone; `model.set_table_dtype` changes it. Training casts trainable tables to float32 in memory without
            changing it, and a save writes the tables as held (`save_pretrained(..., table_dtype=...)` chooses).
        keep_tables_on_cpu: when the model is moved to an accelerator (`.to("cuda")`, `device_map`), tables stay in
            host memory and each forward moves only the rows of the batch's distinct tokens. Set it to False to train
            with DDP or FSDP, which want every parameter on the accelerator.
        fused_table_lookup: whether a STEM layer gathers its table rows inside the kernel that computes
            `SiLU(gate) * rows` (compiled by inductor once; under autograd its backward too, keeping only `gate`), so
            the `[tokens, d_ff]` rows are never a tensor of their own. `None` (the default): on CUDA where Triton is
            installed, for forwards of at least 128 tokens (`FUSED_LOOKUP_MIN_TOKENS`); `True`: on any device
            (inductor compiles for the CPU too), always; `False`: never. Numbers equal to rounding.

    The other fields mean what they mean in `LlamaConfig`.

    ```python
    >>> from stem_hf import StemConfig
    >>> StemConfig(num_hidden_layers=16, stem_layers="1/3").stem_layers
    [1, 4, 7, 10, 13]
    ```"""

    model_type = "stem"
    keys_to_ignore_at_inference = [CACHE_ARG]  # Trainer's evaluation leaves the cache out of the predictions
    # Llama's plan, plus the tables: a table shards along intermediate_size like the up-projection it replaces, and
    # each rank looks up its own slice of the rows (local), which meets gate_proj's local slice before down_proj.
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        "stem_tables.*.weight": "embedding_colwise",
        "stem_tables.*": "local_params",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_out_bias: bool | None = None
    attention_dropout: int | float | None = 0.0
    mlp_bias: bool = False
    qk_norm: bool = False
    stem_layers: list[int] | str | None = "1/3"
    table_dtype: str = "bfloat16"
    keep_tables_on_cpu: bool = True
    fused_table_lookup: bool | None = None
    supported_transformers: str = SUPPORTED_TRANSFORMERS

    def __post_init__(self, **kwargs):
        # The save id stamped into config.json belongs to that file, not to the config: a config saved again as it is
        # must not claim the old save's id.
        kwargs.pop("stem_save_id", None)
        self.supported_transformers = SUPPORTED_TRANSFORMERS  # the range of the code that loads it, not the saver's
        if self.head_dim is None and isinstance(self.num_attention_heads, int) and self.num_attention_heads > 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        _check_sizes(self)
        _check_numbers(self)
        pad = self.pad_token_id  # the embedding's padding_idx: torch takes -vocab_size..vocab_size-1, as Python indexes
        if pad is not None and (
            isinstance(pad, bool) or not isinstance(pad, int) or not -self.vocab_size <= pad < self.vocab_size
        ):
            raise ValueError(
                f"pad_token_id: {pad!r} is neither a token id in the vocabulary [0, {self.vocab_size}), a negative "
                "index into it (as torch takes), nor None"
            )
        if self.attention_out_bias is None:
            self.attention_out_bias = self.attention_bias
        check_table_dtype(self.table_dtype)
        if not any(self.fused_table_lookup is allowed for allowed in (None, True, False)):  # "no" is not False
            raise ValueError(f"fused_table_lookup: {self.fused_table_lookup!r} must be True, False or None (auto)")
        self.stem_layers = self.stem_layers  # resolved by __setattr__, which keeps a ratio to follow num_hidden_layers
        if not self.qk_norm:  # no rule for modules the model does not have (transformers warns about those)
            plan = type(self).base_model_tp_plan
            self.base_model_tp_plan = {k: v for k, v in plan.items() if not k.endswith(("q_norm", "k_norm"))}
        super().__post_init__(**kwargs)
        _check_rope(self.rope_parameters)  # after transformers turns legacy rope fields into rope_parameters

    def __setattr__(self, key, value):
        # Checked and resolved where it is set (the first set, in `__init__`, is resolved by `__post_init__`): a ratio
        # set on a built config (`config.stem_layers = "1/2"`) is the explicit list at once, for the model, the
        # checkpoint checks and the accounting alike. A ratio is kept (`_stem_layers_spec`, never saved) so that
        # setting `num_hidden_layers` after it, as `update` and `from_dict(**kwargs)` may, resolves it again.
        if key == "stem_layers" and key in self.__dict__:
            self.__dict__["_stem_layers_spec"] = value if isinstance(value, str) else None
            value = resolve_stem_layers(value, self.num_hidden_layers)
        elif key == "table_dtype" and key in self.__dict__:
            value = check_table_dtype(value)
        super().__setattr__(key, value)
        spec = self.__dict__.get("_stem_layers_spec")
        if key == "num_hidden_layers" and spec is not None:
            super().__setattr__("stem_layers", resolve_stem_layers(spec, value))

    def to_dict(self) -> dict:
        output = super().to_dict()
        output.pop("_stem_layers_spec", None)
        return output

    @property
    def torch_table_dtype(self) -> torch.dtype:
        """`table_dtype` as a torch dtype."""
        return getattr(torch, self.table_dtype)


__all__ = [
    "STEM_RATIOS",
    "SUPPORTED_TRANSFORMERS",
    "TABLE_DTYPES",
    "StemConfig",
    "check_table_dtype",
    "resolve_stem_layers",
]
