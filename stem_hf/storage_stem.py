"""Checkpoint files of a STEM model: tables in their own safetensors shards next to the dense ones, one index for all,
saves that never leave a half-written checkpoint in place of a good one, and checks that name the file and the tensor
when a checkpoint is broken.

Copied next to the weights by `save_pretrained`: imports nothing beyond the standard library, torch and transformers.
"""

import ctypes
import ctypes.util
import json
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.modeling_utils import safe_save_file
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, logging
from transformers.utils.hub import convert_file_size_to_int

TABLE_KEY = re.compile(r"(?:^|\.)stem_tables\.(\d+)\.weight$")
TABLES_FILE = "stem-tables-{index:05d}-of-{total:05d}.safetensors"
DENSE_FILE = "model-00001-of-00001.safetensors"
# Files a save replaces; anything else in the folder (tokenizer, README, ...) is left alone.
_WEIGHT_FILE = re.compile(r"(model|pytorch_model|stem-tables)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")


def read_safetensors_header(path: str) -> dict:
    """The tensor entries of a safetensors file's header, after checking that the file holds every byte they name."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path} is corrupt: {size} bytes, too short to hold a safetensors header")
        (header_size,) = struct.unpack("<Q", prefix)
        if 8 + header_size > size:
            raise ValueError(
                f"{path} is truncated or corrupt: its header claims {header_size} bytes but the file has {size}"
            )
        try:
            header = json.loads(f.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} is corrupt: its safetensors header is unreadable ({err})") from None
    header.pop("__metadata__", None)
    for name, entry in header.items():
        end = 8 + header_size + entry["data_offsets"][1]
        if end > size:
            raise ValueError(f"{path} is truncated: tensor {name} ends at byte {end} but the file has {size} bytes")
    return header


def check_checkpoint_files(folder: str, vocab_size: int, intermediate_size: int, stem_layers: list[int]) -> None:
    """Raises, naming the file and the tensor, if a local checkpoint misses a shard or a table, holds a truncated or
    corrupt file, or holds a table whose shape disagrees with the config. Does nothing for non-safetensors folders."""
    single, index_path = os.path.join(folder, SAFE_WEIGHTS_NAME), os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(single):  # transformers prefers it over an index
        files = {SAFE_WEIGHTS_NAME: None}
    elif os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        files = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
    else:
        return
    found_tables = set()
    for file, names in files.items():
        path = os.path.join(folder, file)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path} is missing: {SAFE_WEIGHTS_INDEX_NAME} lists it as holding {len(names)} tensor(s), "
                f"among them {sorted(names)[0]}"
            )
        header = read_safetensors_header(path)
        for name in names or ():
            if name not in header:
                raise ValueError(f"{path} lacks tensor {name}, which {SAFE_WEIGHTS_INDEX_NAME} says it holds")
        for name, entry in header.items():
            match = TABLE_KEY.search(name)
            if match is None:
                continue
            layer = int(match.group(1))
            if layer not in stem_layers:
                raise ValueError(
                    f"{path}: tensor {name} is a table for layer {layer}, not in stem_layers {stem_layers}"
                )
            if list(entry["shape"]) != [vocab_size, intermediate_size]:
                raise ValueError(
                    f"{path}: tensor {name} has shape {entry['shape']} but the config expects [vocab_size, "
                    f"intermediate_size] = [{vocab_size}, {intermediate_size}]"
                )
            found_tables.add(layer)
    missing = sorted(set(stem_layers) - found_tables)
    if missing:
        raise ValueError(
            f"{folder}: the config lists STEM layer {missing[0]} but no file holds its table (stem_tables.{missing[0]}"
            f".weight); STEM layers without a table: {missing}"
        )


def save_tables(tables: dict[str, torch.Tensor], folder: str, dtype: torch.dtype, max_shard_size: int | str) -> dict:
    """Writes the tables in `dtype` to `stem-tables-XXXXX-of-YYYYY.safetensors` files of at most `max_shard_size`
    (a table larger than that gets a file of its own), one table cast at a time. Returns their weight map."""
    limit = convert_file_size_to_int(max_shard_size)
    shards, size = [[]], 0
    for name in sorted(tables, key=lambda n: int(TABLE_KEY.search(n).group(1))):
        nbytes = tables[name].numel() * dtype.itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    shards = [names for names in shards if names]
    weight_map = {}
    for i, names in enumerate(logging.tqdm(shards, desc="Writing STEM tables", disable=not shards), start=1):
        file = TABLES_FILE.format(index=i, total=len(shards))
        shard = {name: tables[name].detach().to(device="cpu", dtype=dtype).contiguous() for name in names}
        safe_save_file(shard, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    return weight_map


def finish_checkpoint(
    folder: str, tables: dict[str, torch.Tensor], dtype: torch.dtype, max_shard_size, total_parameters: int
):
    """Adds the tables to a folder where transformers saved the dense weights, and writes one index for all files."""
    index_path = os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        # An index beside `model.safetensors` would be ignored: transformers loads the single file first.
        os.rename(os.path.join(folder, SAFE_WEIGHTS_NAME), os.path.join(folder, DENSE_FILE))
        weight_map = dict.fromkeys(read_safetensors_header(os.path.join(folder, DENSE_FILE)), DENSE_FILE)
    weight_map.update(save_tables(tables, folder, dtype, max_shard_size))
    total_size = 0
    for file in set(weight_map.values()):
        total_size += sum(
            e["data_offsets"][1] - e["data_offsets"][0]
            for e in read_safetensors_header(os.path.join(folder, file)).values()
        )
    index = {
        "metadata": {"total_parameters": total_parameters, "total_size": total_size},
        "weight_map": dict(sorted(weight_map.items())),
    }
    with open(index_path, "w") as f:
        f.write(json.dumps(index, indent=2) + "\n")


_MADV_RANDOM = 1  # the same value on Linux and macOS


def advise_random_access(tensor: torch.Tensor) -> bool:
    """Tells the kernel that a memory-mapped tensor is read at random. Without it, each page fault on a table reads
    ahead its neighbours, so a forward that needs 3% of a table's rows pulls ~14% of its bytes from disk; with it, ~4%.
    Only a hint: returns False where the platform has no `madvise`."""
    if os.name != "posix" or tensor.device.type != "cpu" or tensor.numel() == 0:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return False
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    return libc.madvise(start, end - start, _MADV_RANDOM) == 0


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def staged_folder(target: str | os.PathLike) -> Iterator[str]:
    """Yields an empty folder beside `target` to save into, then commits it: a new `target` appears in one rename; an
    existing one gets each file replaced by rename, stale weight files removed, and the index put in place last. Every
    byte is on disk before the first rename, and nothing in `target` is touched if the save fails."""
    target = os.path.abspath(target)
    if os.path.isfile(target):
        raise NotADirectoryError(f"{target} is a file; save_pretrained needs a folder")
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    # Stage inside an existing target (same filesystem even if it is a mount point), beside a new one.
    staging = tempfile.mkdtemp(prefix=".stem-saving-", dir=target if os.path.isdir(target) else parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes it private; a new checkpoint gets the usual permissions
    try:
        yield staging
        for name in os.listdir(staging):
            _fsync(os.path.join(staging, name))
        if not os.path.exists(target):
            os.rename(staging, target)
        else:
            new = os.listdir(staging)
            stale = [f for f in os.listdir(target) if _WEIGHT_FILE.fullmatch(f) and f not in new]
            for name in new:  # files mkstemp-like writers made private get the usual permissions too
                os.chmod(os.path.join(staging, name), 0o666 & ~umask)
            for name in sorted(new, key=lambda f: f == SAFE_WEIGHTS_INDEX_NAME):
                os.replace(os.path.join(staging, name), os.path.join(target, name))
            for name in stale:
                os.remove(os.path.join(target, name))
        _fsync(parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


__all__ = [
    "advise_random_access",
    "check_checkpoint_files",
    "finish_checkpoint",
    "read_safetensors_header",
    "staged_folder",
    "TABLE_KEY",
]
