"""Size and cost of a STEM model next to the dense model of the same shape, from its config alone; and the checks every
command runs on a checkpoint argument before anything loads it (reading its config as plain JSON). The machine's own
limits (memory, disk room) are in `system`."""

import json
import os

import torch
from huggingface_hub.utils import HFValidationError, validate_repo_id
from torch import nn

from .checkpoint_stem import CONFIG_NAME
from .configuration_stem import StemConfig
from .modeling_stem import StemForCausalLM

# Conventions follow the paper: the token embedding and the LM head count as active parameters, and a STEM layer
# activates one table row (intermediate_size parameters) per token.


def num_table_parameters(model: nn.Module) -> int:
    """Parameters held in STEM tables."""
    return sum(p.numel() for p in model.base_model.stem_tables.parameters())


def num_active_parameters(model: nn.Module) -> int:
    """Parameters that one token's forward uses: everything but the tables, plus one row per STEM layer."""
    rows = len(model.config.stem_layers) * model.config.intermediate_size
    return model.num_parameters() - num_table_parameters(model) + rows


def num_dense_parameters(model: nn.Module) -> int:
    """Parameters of the dense model of the same shape (each table replaced by an up-projection)."""
    config = model.config
    up_proj = config.hidden_size * config.intermediate_size + (config.intermediate_size if config.mlp_bias else 0)
    return model.num_parameters() - num_table_parameters(model) + len(config.stem_layers) * up_proj


def flops_per_token(config: StemConfig, context_length: int, dense: bool = False) -> int:
    """Forward FLOPs (2 per multiply-add) of one token that attends to `context_length` positions, LM head included.

    `dense=True` gives the dense model of the same shape. Per STEM layer, STEM saves `2 * hidden * intermediate`
    FLOPs. For a causal sequence of length L the mean context is (L + 1) / 2; the paper's saved-fraction formula
    `d_ff / (4d + 2L + 3 d_ff)` uses L.
    """
    d, d_ff, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q_width, kv_width = config.num_attention_heads * hd, config.num_key_value_heads * hd
    attention = 2 * d * q_width + 2 * d * kv_width + 2 * q_width * context_length
    n_stem = 0 if dense else len(config.stem_layers)
    mlp = 3 * d * d_ff * (config.num_hidden_layers - n_stem) + 2 * d * d_ff * n_stem
    return 2 * (attention * config.num_hidden_layers + mlp + d * config.vocab_size)


def summarize(config: StemConfig, context_length: int = 2048) -> dict:
    """Parameter counts and forward FLOPs per token, STEM vs dense. Builds the model on the meta device: no memory."""
    with torch.device("meta"):
        model = StemForCausalLM(config)
    stem_flops = flops_per_token(config, context_length)
    dense_flops = flops_per_token(config, context_length, dense=True)
    return {
        "stem_layers": list(config.stem_layers),
        "num_hidden_layers": config.num_hidden_layers,
        "total_params": model.num_parameters(),
        "table_params": num_table_parameters(model),
        "active_params_per_token": num_active_parameters(model),
        "dense_params": num_dense_parameters(model),
        "context_length": context_length,
        "flops_per_token": stem_flops,
        "dense_flops_per_token": dense_flops,
        "flops_ratio_stem_over_dense": stem_flops / dense_flops,
    }


# The offload store's file beside a checkpoint's weights (`stem-hf offload-store`): a token-major copy of the tables,
# `table_bytes` large. Named here so that `hub` leaves it out of a push without importing the offload engine.
STORE_NAME = "stem-offload-store.safetensors"


def table_bytes(config: StemConfig) -> int:
    """Bytes of a STEM config's tables in `config.table_dtype`."""
    itemsize = config.torch_table_dtype.itemsize
    return len(config.stem_layers) * config.vocab_size * config.intermediate_size * itemsize


def looks_like_path(name: str) -> bool:
    """Whether `name` can only be a local path: Hub ids are `name` or `owner/name`, not `./x`, `/x`, `~/x`, `a/b/c`."""
    separators = name.count("/") + (name.count(os.sep) if os.sep != "/" else 0)
    if name.startswith((".", "/", "~", os.sep)) or separators > 1:
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def check_local(path_or_id: str, hub: bool = True) -> bool:
    """True if `path_or_id` exists here, False for a Hub id. A missing path that cannot be a Hub id (any missing path
    with `hub=False`) raises, so that a mistyped folder is not reported as a malformed Hub repo id."""
    if os.path.exists(path_or_id):
        return True
    if not hub or looks_like_path(path_or_id):
        raise FileNotFoundError(f"{path_or_id}: no such folder")
    return False


def read_model_type(path_or_id: str, hub: bool = True) -> str | None:
    """The `model_type` of a checkpoint folder or Hub id, from its config.json parsed as plain JSON: no transformers
    class and none of the checkpoint's own code (`auto_map`) runs, so a command can refuse it before loading it."""
    return read_config_json(path_or_id, hub).get("model_type")


def read_config_json(path_or_id: str, hub: bool = True) -> dict:
    """The config.json of a checkpoint folder or Hub id, parsed as plain JSON (see `read_model_type`)."""
    if check_local(path_or_id, hub):
        if not os.path.isdir(path_or_id):
            raise NotADirectoryError(f"{path_or_id} is a file, not a checkpoint folder")
        path = os.path.join(path_or_id, CONFIG_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path_or_id} holds no {CONFIG_NAME}: not a checkpoint folder")
    else:
        from huggingface_hub import hf_hub_download

        try:
            path = hf_hub_download(path_or_id, CONFIG_NAME)
        except (OSError, ValueError) as error:  # no repo, no file, offline, gated: all of them say what was tried
            raise FileNotFoundError(
                f"{path_or_id}: no such folder, nor a Hub repo whose {CONFIG_NAME} could be read "
                f"({type(error).__name__}: {error})"
            ) from error
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable {CONFIG_NAME} ({error})") from error
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a {CONFIG_NAME} (a JSON object)")
    return config


def check_stem(path_or_id: str, hub: bool = True) -> None:
    """Raises unless `path_or_id` holds a STEM config: what a command checks before loading anything from it."""
    model_type = read_model_type(path_or_id, hub)
    if model_type != StemConfig.model_type:
        raise ValueError(f"{path_or_id} holds a {model_type!r} config, not a STEM one (model_type 'stem')")


def load_config(path_or_id: str, hub: bool = True) -> StemConfig:
    """The `StemConfig` of a checkpoint, built by this package's class: a checkpoint's copied code never runs, and a
    non-STEM one is refused before transformers reads it. `hub=False`: local folders only."""
    check_stem(path_or_id, hub)
    return StemConfig.from_pretrained(path_or_id)
