"""Size and cost of a STEM model next to the dense model of the same shape, from its config alone; and the checks every
command runs on a checkpoint argument before anything loads it."""

import json
import os
import shutil

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


def available_memory() -> int | None:
    """Bytes of memory that can be had without swapping: Linux's MemAvailable, or less where this process's cgroup
    (a container) is limited to less; None where the kernel does not say."""
    try:
        with open("/proc/meminfo") as f:
            available = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except OSError:
        return None
    rooms = [room for room in (available, _cgroup_room()) if room is not None]
    return min(rooms) if rooms else None


def format_bytes(n: float) -> str:
    """`n` bytes for a message, in the decimal unit that fits: "512 B", "25.0 MB", "1.2 TB"."""
    if abs(n) < 1000:
        return f"{n:.0f} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1000
        if abs(n) < 999.95:  # what rounds to 1000.0 shows as 1.0 of the next unit
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.1f} TB"


def check_disk_room(path: str | os.PathLike, nbytes: int, what: str, detail: str = "") -> None:
    """Raises ("PATH: `what` 25.0 MB`detail` and ... has 10.0 MB free") where the filesystem `path` will be written on
    (that of its nearest existing folder) has less than `nbytes` free: files that fill as rows come would otherwise run
    out of room only hours in."""
    folder = os.path.abspath(path)
    while not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    free = shutil.disk_usage(folder).free
    if free < nbytes:
        raise OSError(f"{path}: {what} {format_bytes(nbytes)}{detail} and {folder} has {format_bytes(free)} free")


def _cgroup_paths() -> dict[str, str]:
    """This process's cgroup paths from /proc/self/cgroup: the v2 one under "", v1 ones under their controllers."""
    paths = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.strip().split(":", 2)
                for controller in controllers.split(",") if controllers else [""]:
                    paths[controller] = path
    except (OSError, ValueError):
        pass
    return paths


def _read_room(folder: str, limit_name: str, usage_name: str, inactive_key: str) -> int | None:
    """Limit less usage plus droppable page cache in one cgroup folder; None where it has no limit or no such files."""
    try:
        with open(os.path.join(folder, limit_name)) as f:
            limit = f.read().strip()
        with open(os.path.join(folder, usage_name)) as f:
            usage = int(f.read().strip())
        with open(os.path.join(folder, "memory.stat")) as f:
            stat = dict(line.split()[:2] for line in f if line.strip())
    except (OSError, ValueError):
        return None
    limits = [int(limit)] if limit != "max" else []
    if "hierarchical_memory_limit" in stat:  # v1: the tightest limit of this group and its ancestors
        limits.append(int(stat["hierarchical_memory_limit"]))
    limits = [n for n in limits if n < 2**60]  # v1 writes "no limit" as a huge number
    return max(0, min(limits) - usage + int(stat.get(inactive_key, 0))) if limits else None


def _cgroup_room(root: str = "/sys/fs/cgroup") -> int | None:
    """What this process's cgroup memory limits leave: the limit less the usage, less page cache the kernel can drop
    (inactive file pages, as `docker stats` counts), at the tightest of its group and their ancestors (cgroup v2),
    else of its v1 memory group (or the root a container sees); None without a limit."""
    paths, rooms = _cgroup_paths(), []
    group = paths.get("", "/").strip("/")
    while True:  # v2: this group, then each ancestor up to the root
        rooms.append(_read_room(os.path.join(root, group), "memory.max", "memory.current", "inactive_file"))
        if not group:
            break
        group = os.path.dirname(group)
    v1 = paths.get("memory", "/").strip("/")
    for folder in dict.fromkeys([os.path.join(root, "memory", v1), os.path.join(root, "memory")]):
        if os.path.isdir(folder):
            rooms.append(_read_room(folder, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
            break
    rooms = [room for room in rooms if room is not None]
    return min(rooms) if rooms else None


def table_bytes(config: StemConfig) -> int:
    """Bytes of a STEM config's tables in `config.table_dtype`."""
    itemsize = getattr(torch, config.table_dtype).itemsize
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
