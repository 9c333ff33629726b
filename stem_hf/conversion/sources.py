"""Dense source checkpoints: load them (folder, Hub id or .gguf file) and map their config onto a `StemConfig`, refusing
what STEM cannot represent instead of converting it silently wrong; the STEM model that starts from their weights."""

import os
import re
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .. import StemConfig, StemForCausalLM
from ..accounting import check_local, read_config_json
from ..checkpoint_stem import CONFIG_NAME
from ..modeling_stem import StemRotaryEmbedding

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "Source",
    "check_source_and_out",
    "check_source_type",
    "copy_dense_weights",
    "load_source",
    "load_source_config",
    "open_source",
    "split_gguf",
    "stem_config_from_dense",
    "stem_from_dense",
]

HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")

SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def split_gguf(source: str) -> tuple[str, dict]:
    if source.endswith(".gguf"):
        if not os.path.isfile(source):
            raise FileNotFoundError(f"{source}: no such GGUF file")
        return os.path.dirname(os.path.abspath(source)), {"gguf_file": os.path.basename(source)}
    return source, {}


def check_source_type(source: str) -> None:
    """Refuses a folder or Hub source whose config.json, read as plain JSON, names an architecture convert does not
    support: transformers never sees it, so code the source ships (`auto_map`) never runs nor prompts to run. A GGUF
    file names its architecture inside, and transformers reads that without any code."""
    path, extra = split_gguf(source)
    if extra:
        return
    config = read_config_json(path)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        own_code = "; it ships its own code (auto_map), which stem-hf never runs" if "auto_map" in config else ""
        raise _unsupported(
            model_type, config.get("architectures"), f" (its {CONFIG_NAME} has model_type {model_type!r}{own_code})"
        )


def load_source_config(source: str) -> PreTrainedConfig:
    """The source's config, by transformers' own classes only, once `check_source_type` has read it as JSON."""
    check_source_type(source)
    path, extra = split_gguf(source)
    return AutoConfig.from_pretrained(path, trust_remote_code=False, **extra)


def _unsupported(model_type: str | None, architectures: list | None, detail: str = "") -> ValueError:
    supported = ", ".join(SUPPORTED_ARCHITECTURES.values())
    architecture = (architectures or [model_type])[0]
    return ValueError(f"cannot convert {architecture}: supported source architectures are {supported}{detail}")


def _refuse(config: PreTrainedConfig, feature: str) -> ValueError:
    return ValueError(f"{config.model_type} checkpoint uses {feature}, which STEM does not implement; not converting")


def stem_config_from_dense(
    config: PreTrainedConfig, stem_layers: str | list[int], table_dtype: str = "bfloat16"
) -> StemConfig:
    """The `StemConfig` of a dense Llama, Mistral, Qwen2 or Qwen3 config, with `stem_layers` resolved."""
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise _unsupported(config.model_type, getattr(config, "architectures", None))
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:  # Qwen2/3: the per-layer types say which layers slide
        if any(kind != "full_attention" for kind in layer_types):
            raise _refuse(config, "sliding-window attention in some layers")
    elif getattr(config, "sliding_window", None) is not None and config.sliding_window < config.max_position_embeddings:
        raise _refuse(config, f"sliding-window attention (window {config.sliding_window})")
    rope = dict(config.rope_parameters)
    if rope.get("rope_type", "default") not in ("default", *ROPE_INIT_FUNCTIONS):
        raise _refuse(config, f"rope type {rope['rope_type']!r}")
    if config.hidden_act not in ("silu", "swish"):
        raise _refuse(config, f"a {config.hidden_act!r} gate (STEM here is SwiGLU)")
    attention_bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
    return StemConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=rope,
        attention_bias=attention_bias,
        attention_out_bias=attention_bias and config.model_type != "qwen2",  # Qwen2: q, k, v biases only
        attention_dropout=config.attention_dropout,
        mlp_bias=getattr(config, "mlp_bias", False),
        qk_norm=config.model_type == "qwen3",
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        # Some configs mark "no pad token" with -1: STEM's config takes None for that.
        pad_token_id=config.pad_token_id if 0 <= (config.pad_token_id or 0) < config.vocab_size else None,
        stem_layers=stem_layers,
        table_dtype=table_dtype,
    )


def load_source(source: str) -> tuple[nn.Module, object | None]:
    """Returns `(dense_model, tokenizer_or_None)` in fp32 on CPU. Checks the architecture before reading any weight."""
    config = load_source_config(source)
    stem_config_from_dense(config, [])  # refuses unsupported sources early
    path, extra = split_gguf(source)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=False, **extra).eval()
    if getattr(model.config, "quantization_config", None) is not None:  # dequantized GGUF: plain fp32 weights now
        del model.config.quantization_config
        model.hf_quantizer = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False, **extra)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    return model, tokenizer


@dataclass
class Source:
    """A loaded dense model, the tokenizer for its text (None if there is none), and what the report and the model card
    call it: its name, its Hub id and its license id."""

    model: nn.Module
    tokenizer: object | None
    name: str
    base_model: str | None = None
    license: str | None = None


def open_source(
    source: "str | os.PathLike | nn.Module | Source",
    tokenizer: object | None = None,
    base_model: str | None = None,
    license: str | None = None,
) -> Source:
    """Loads `source` (a folder, Hub id or `.gguf` file; a loaded model, or a `Source`, is taken as it is). `tokenizer`,
    when given, replaces the source's own; `base_model` defaults to `source` when that is a Hub id."""
    if isinstance(source, Source):
        return source
    if isinstance(source, (str, os.PathLike)):
        dense, loaded = load_source(os.fspath(source))
        tokenizer, name = tokenizer or loaded, os.fspath(source)
    else:
        dense, name = source.eval(), source.config.name_or_path or type(source).__name__
    if base_model is None and isinstance(source, str) and not os.path.exists(source) and HUB_ID.fullmatch(source):
        base_model = source
    return Source(dense, tokenizer, name, base_model, license)


def check_source_and_out(
    source: str | os.PathLike | nn.Module,
    out: str | os.PathLike | None,
    stem_layers: str | list[int],
    table_dtype: str = "bfloat16",
) -> StemConfig | None:
    """What can go wrong before a source loads, checked from its config alone: a path source exists (a missing folder
    is named as such, not tried as a Hub id), `out` is a folder and not the source's own (saving there would replace
    the dense checkpoint), the architecture is supported and `stem_layers` fits its layers. Returns the `StemConfig`
    the conversion will build (None for an already-loaded source, whose config is checked when it is used)."""
    if out is not None and os.path.isfile(out):
        raise FileExistsError(f"out: {os.fspath(out)} is a file; the STEM checkpoint is written to a folder")
    if not isinstance(source, (str, os.PathLike)):
        return None
    source = os.fspath(source)
    gguf = source.endswith(".gguf")
    if not gguf:
        check_local(source)  # a missing folder is named as such
    folder = os.path.dirname(os.path.abspath(source)) if gguf else source
    if out is not None and os.path.isdir(out) and os.path.isdir(folder) and os.path.samefile(out, folder):
        raise ValueError(
            f"out: {os.fspath(out)} is the source's own folder ({source}); the STEM checkpoint would replace its "
            "weights and config: choose another folder"
        )
    # A Hub id that is no repo is named as such by `check_source_type`, which reads its config.json first.
    return stem_config_from_dense(load_source_config(source), stem_layers, table_dtype)


def copy_dense_weights(dense: nn.Module, stem: StemForCausalLM, share: bool = False) -> None:
    """Every dense weight but the STEM layers' up-projections, by name (STEM keeps Llama's names), in float32. `share`:
    `stem` takes the dense model's own float32 tensors instead of copies, so nothing may then write to either in place
    (a refit or healing would change both)."""
    dropped = {f"model.layers.{i}.mlp.up_proj.{p}" for i in stem.config.stem_layers for p in ("weight", "bias")}
    state = {}
    for name, tensor in dense.state_dict().items():
        if name not in dropped:
            copied = tensor.to(torch.float32)
            state[name] = copied if share or copied.data_ptr() != tensor.data_ptr() else copied.clone()
    missing, unexpected = stem.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if "stem_tables" not in k]
    if missing or unexpected:
        raise RuntimeError(f"dense and STEM weights do not line up: missing {missing}, unexpected {unexpected}")
    if stem.config.tie_word_embeddings:  # two parameters on one tensor after the assignment: one parameter again
        stem.lm_head.weight = stem.model.embed_tokens.weight


def stem_from_dense(
    dense: nn.Module,
    stem_layers: str | list[int],
    table_dtype: str,
    allocate_tables: bool = True,
    share_weights: bool = False,
) -> StemForCausalLM:
    """The STEM model of `dense` with `stem_layers` converted, built without initializing anything it then replaces:
    every dense weight copied (`copy_dense_weights`; `share_weights` takes the dense model's own tensors), the tables
    allocated but not set (`init_tables` sets every row) or, without `allocate_tables`, left on the meta device for a
    conversion that writes them to disk to map in (`StemTableStream`): tables are then never in memory."""
    config = stem_config_from_dense(dense.config, stem_layers, table_dtype)
    with torch.device("meta"):
        stem = StemForCausalLM(config)
    stem.model.rotary_emb = StemRotaryEmbedding(config)  # computed, not loaded
    copy_dense_weights(dense, stem, share=share_weights)
    if allocate_tables:
        for table in stem.model.stem_tables.values():
            table.weight = nn.Parameter(torch.empty(table.weight.shape, dtype=table.weight.dtype))
    stem.eval()
    stem.generation_config = dense.generation_config
    return stem
