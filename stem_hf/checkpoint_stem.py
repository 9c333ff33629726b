"""Checkpoint files of a STEM model: tables in their own safetensors shards next to the dense ones, one index for all,
saves that never leave a half-written checkpoint in place of a good one, and checks that name the file and the tensor
when a checkpoint is broken.

Copied next to the weights by `save_pretrained`: imports nothing beyond the standard library, torch and transformers.
"""

import ctypes
import ctypes.util
import dataclasses
import importlib
import json
import math
import os
import re
import secrets
import shutil
import struct
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import transformers
from transformers.utils import logging

from .configuration_stem import (
    SUPPORTED_TRANSFORMERS,
    TABLE_DTYPES,
    StemConfig,
    check_table_dtype,
    resolve_stem_layers,
)

logger = logging.get_logger(__name__)

# transformers' file names, spelled here so that this file imports no name transformers' model files do not.
CONFIG_NAME = "config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
TABLE_KEY = re.compile(r"(?:^|\.)stem_tables\.(\d+)\.weight$")
# The tables' shards, named as transformers names the dense ones: `stem-tables[.VARIANT]-XXXXX-of-YYYYY.safetensors`.
TABLES_NAME = "stem-tables.safetensors"
# Every weight file of a save and its index carry this key with one fresh id: files of two saves are told apart at load.
SAVE_ID_KEY = "stem_save_id"
# Provenance files beside the weights, each recording the save id of the weights it describes: how they were made
# (`stem-hf convert`) and how they score (`stem-hf eval`). The model card renders both.
REPORT_FILE = "conversion_report.json"
RESULTS_FILE = "lm_eval_results.json"
PROVENANCE_FILES = (REPORT_FILE, RESULTS_FILE)
# Bits per element of each safetensors dtype (the sub-byte float formats pack elements): the bytes a tensor must span.
_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
    "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4,
    "F6_E2M3": 6, "F6_E3M2": 6,
}  # fmt: skip
# A table with no rows: what `StemOffloadEngine(free_tables=True)` leaves in the model while it serves the rows.
FREED_TABLES = (
    "the model's tables were freed by StemOffloadEngine(free_tables=True), which serves their rows only while "
    "attached; attach the engine, or detach it first (engine.detach() rebuilds the tables, unless its store is int8)"
)
_VARIANT = re.compile(r"[A-Za-z0-9_-]+")
_STAGING_PREFIX = ".stem-saving-"
# A staging folder nobody holds is a killed save's once it is this old; younger, it may be one that is just starting.
_STALE_AFTER_S = 60.0
# Where no lock can tell (no fcntl, or a file system without flock): only this old.
_STALE_UNLOCKED_AFTER_S = 24 * 3600.0


def _transformers_name(module: str, name: str):
    """A transformers name that its model files do not import, imported where it is used: a rename in a release
    outside the supported range fails there, with the range in the error, not when the model is imported."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ImportError(
            f"{module}.{name} is missing from transformers {transformers.__version__}; STEM checkpoints are tested "
            f"with transformers{SUPPORTED_TRANSFORMERS} ({error})"
        ) from error


def check_variant(variant: str | None) -> None:
    """Raises unless `variant` is None or a plain name ("fp16", "ema"): it goes into file names."""
    if variant is not None and not _VARIANT.fullmatch(variant):
        raise ValueError(f"variant: {variant!r} is not a plain name (letters, digits, '_' and '-')")


def variant_name(name: str, variant: str | None = None) -> str:
    """`name` as transformers names it for `variant` (its private `_add_variant`): `model.safetensors` ->
    `model.fp16.safetensors`, `model.safetensors.index.json` -> `model.safetensors.index.fp16.json`."""
    if not variant:
        return name
    base, extension = name.rsplit(".", 1)
    return f"{base}.{variant}.{extension}"


def _shard_name(name: str, variant: str | None, index: int, total: int) -> str:
    """transformers' shard naming: `model.safetensors` -> `model[.VARIANT]-00001-of-00002.safetensors`."""
    base = variant_name(name, variant).removesuffix(".safetensors")
    return f"{base}-{index:05d}-of-{total:05d}.safetensors"


def _weight_files(variant: str | None) -> re.Pattern:
    """The files a save of `variant` replaces; other variants' weights and anything else (tokenizer, README...) stay."""
    v = "" if not variant else r"\." + re.escape(variant)
    shards = rf"(?:model|pytorch_model|stem-tables){v}(?:-\d{{5}}-of-\d{{5}})?\.(?:safetensors|bin)"
    return re.compile(rf"{shards}|(?:model\.safetensors|pytorch_model\.bin)\.index{v}\.json")


def _read_header(path: str) -> tuple[dict, dict]:
    """`(tensor entries, metadata)` of a safetensors file's header, after checking that the entries are well formed,
    that the file holds every byte they name, and that their `data_offsets` tile the data exactly as the format
    requires (no overlap, no gap, each tensor's span its dtype times its shape)."""
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
    if not isinstance(header, dict):
        raise ValueError(f"{path} is corrupt: its safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"{path} is corrupt: its __metadata__ is not a JSON object")
    spans = []
    for name, entry in header.items():
        corrupt = f"{path} is corrupt: tensor {name}"
        if not isinstance(entry, dict):
            raise ValueError(f"{corrupt} has no header entry (dtype, shape, data_offsets)")
        for field in ("dtype", "shape", "data_offsets"):
            if field not in entry:
                raise ValueError(f"{corrupt} has no {field} in its header entry")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str):
            raise ValueError(f"{corrupt} has dtype {dtype!r}, not a safetensors dtype name")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"{corrupt} has shape {shape!r}, not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int and n >= 0 for n in offsets)):
            raise ValueError(f"{corrupt} has data_offsets {offsets!r}, not [begin, end]")
        begin, end = offsets
        if end < begin:
            raise ValueError(f"{corrupt} ends before it begins: data_offsets {offsets}")
        if 8 + header_size + end > size:
            raise ValueError(
                f"{path} is truncated: tensor {name} ends at byte {8 + header_size + end} but the file has {size} bytes"
            )
        bits = _DTYPE_BITS.get(dtype)  # a dtype newer than this list: its size is safetensors' to check
        if bits is not None and (end - begin) * 8 != math.prod(shape) * bits:
            raise ValueError(
                f"{corrupt} spans {end - begin} bytes but a {dtype} tensor of shape {shape} takes "
                f"{math.prod(shape) * bits // 8} (data_offsets {offsets})"
            )
        spans.append((begin, end, name))
    position, previous = 0, None
    for begin, end, name in sorted(spans):
        if begin < position:
            raise ValueError(
                f"{path} is corrupt: tensor {name} overlaps tensor {previous} (data_offsets [{begin}, {end}], "
                f"{previous} ends at {position})"
            )
        if begin > position:
            raise ValueError(f"{path} is corrupt: tensor {name} begins at {begin}, leaving a gap after byte {position}")
        position, previous = end, name
    if 8 + header_size + position != size:
        raise ValueError(f"{path} is corrupt: {size - 8 - header_size - position} bytes after its last tensor")
    return header, metadata


def read_safetensors_header(path: str) -> dict:
    """The tensor entries of a safetensors file's header, after checking that they are consistent and that the file
    holds every byte they name; errors name the file and the tensor."""
    return _read_header(path)[0]


def read_safetensors_metadata(path: str) -> dict:
    """The `__metadata__` of a safetensors file, after `read_safetensors_header`'s checks of the whole file."""
    return _read_header(path)[1]


def read_index(path: str) -> dict:
    """A safetensors index, checked to be JSON with a `weight_map` of tensor names to file names."""
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}): re-run save_pretrained or restore the file") from None
    if not isinstance(index, dict) or "weight_map" not in index:
        raise ValueError(f'{path} has no "weight_map", which maps each tensor to the file that holds it')
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f'{path} is corrupt: its "weight_map" must map tensor names to file names')
    if not isinstance(index.get("metadata") or {}, dict):
        raise ValueError(f'{path} is corrupt: its "metadata" is not a JSON object')
    return index


def _leaves_folder(file: str) -> bool:
    """Whether an index entry names a file outside the checkpoint folder: absolute, on another drive, or climbing out
    with `..`. Decided on the path as written, not by resolving links: a Hub cache snapshot's files are links to blobs
    outside the snapshot folder, and they belong to it."""
    if not file or os.path.isabs(file) or os.path.splitdrive(file)[0]:
        return True
    normal = os.path.normpath(file)
    return normal in (os.curdir, os.pardir) or normal.startswith(os.pardir + os.sep)


# The dtypes a table may be stored in (`configuration_stem.TABLE_DTYPES`), and those of any other weight: a load casts
# what it reads to the model's dtype, which would turn integers into wrong numbers without a word.
_TABLE_STORAGE = ("BF16", "F16", "F32")
_FLOAT_STORAGE = ("BF16", "F16", "F32", "F64", "F8_E5M2", "F8_E4M3")
_ANY_INDEX = re.compile(r"model\.safetensors\.index(?:\.([A-Za-z0-9_-]+))?\.json")
_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _check_tables(path: str, header: dict, config: StemConfig) -> set[int]:
    """The STEM layers whose tables the file at `path` holds; raises on a table of another layer, shape or dtype."""
    found = set()
    for name, entry in header.items():
        match = TABLE_KEY.search(name)
        if match is None:
            continue
        layer = int(match.group(1))
        if layer not in config.stem_layers:
            raise ValueError(
                f"{path}: tensor {name} is a table for layer {layer}, not in stem_layers {config.stem_layers}"
            )
        if list(entry["shape"]) != [config.vocab_size, config.intermediate_size]:
            raise ValueError(
                f"{path}: tensor {name} has shape {entry['shape']} but the config expects [vocab_size, "
                f"intermediate_size] = [{config.vocab_size}, {config.intermediate_size}]"
            )
        if entry["dtype"] not in _TABLE_STORAGE:
            raise ValueError(
                f"{path}: tensor {name} is stored as {entry['dtype']}; a table is stored as one of "
                f"{', '.join(_TABLE_STORAGE)} (loading would cast its values to other numbers)"
            )
        found.add(layer)
    return found


def _check_dense(path: str, header: dict, config: StemConfig) -> set[int]:
    """The decoder layers whose weights the file at `path` holds; raises on a weight stored as integers (a quantized
    checkpoint, which says so in its config, aside)."""
    layers = set()
    for name, entry in header.items():
        if entry["dtype"] not in _FLOAT_STORAGE and getattr(config, "quantization_config", None) is None:
            raise ValueError(
                f"{path}: tensor {name} is stored as {entry['dtype']}, not as floating point, and the config declares "
                "no quantization: loading would cast its values to other numbers"
            )
        match = _LAYER_KEY.search(name)
        if match is not None:
            layers.add(int(match.group(1)))
    return layers


def _check_layer_count(folder: str, layers: set[int], config: StemConfig) -> None:
    expected = set(range(config.num_hidden_layers))
    if layers != expected:
        held = f"layers {min(layers)}..{max(layers)} ({len(layers)} of them)" if layers else "no decoder layer"
        raise ValueError(
            f"{folder}: config.json says num_hidden_layers={config.num_hidden_layers} but the weight files hold "
            f"{held}; the config belongs to another checkpoint or was edited"
        )


def _missing_index(folder: str, index_name: str, variant: str | None) -> None:
    """Raises if `folder` holds shards of `variant` but not the index that lists them (transformers would look for a
    single file), or only another variant's weights."""
    v = "" if not variant else re.escape("." + variant)
    shard = re.compile(rf"(?:model|stem-tables){v}-\d{{5}}-of-\d{{5}}\.safetensors")
    entries = os.listdir(folder)
    shards = sorted(name for name in entries if shard.fullmatch(name))
    if shards:
        raise FileNotFoundError(
            f"{os.path.join(folder, index_name)} is missing: {folder} holds weight shards ({shards[0]}, ...) but not "
            "the index that lists them; restore it from the checkpoint's source or save the model again"
        )
    others = sorted(m.group(1) or "" for m in map(_ANY_INDEX.fullmatch, entries) if m)
    if others:
        shown = ", ".join(f"variant={o!r}" if o else "variant=None" for o in others)
        raise FileNotFoundError(f"{folder} has no {index_name}: it holds the weights of {shown}; load one of them")


def check_checkpoint_files(folder: str, config: StemConfig, variant: str | None = None) -> str | None:
    """Raises, naming the file and the tensor, if a local checkpoint (of `variant`, as `from_pretrained(...,
    variant=...)` loads it) misses its index, a shard or a table, holds a truncated or corrupt file or index, an index
    entry outside the folder, files of two saves (a save killed between its renames), a table whose shape or dtype
    disagrees with the config, weights stored as integers, or another number of decoder layers than the config's.
    Returns the checkpoint's save id (None for one saved before save ids, or without an index). Does nothing for
    non-safetensors folders."""
    check_variant(variant or None)
    single = variant_name(SAFE_WEIGHTS_NAME, variant)
    index_name = variant_name(SAFE_WEIGHTS_INDEX_NAME, variant)
    index_path = os.path.join(folder, index_name)
    save_id = None
    if os.path.isfile(os.path.join(folder, single)):  # transformers prefers it over an index
        files = {single: None}
    elif os.path.isfile(index_path):
        index = read_index(index_path)
        save_id = (index.get("metadata") or {}).get(SAVE_ID_KEY)
        files = {}
        for name, file in index["weight_map"].items():
            if _leaves_folder(file):
                raise ValueError(
                    f"{index_path}: entry {file!r} for {name} points outside {folder}; an index may only name files "
                    "inside its checkpoint folder"
                )
            files.setdefault(file, []).append(name)
    else:
        _missing_index(folder, index_name, variant)
        return None
    config_id = _config_save_id(folder)
    if config_id is not None and config_id not in folder_save_ids(folder):
        raise ValueError(
            f"incomplete save: {os.path.join(folder, CONFIG_NAME)} belongs to another save (stem_save_id {config_id}) "
            f"than any index in {folder}: a save into it was interrupted between its renames, or the config was copied "
            f"from another checkpoint; re-run save_pretrained (or remove {SAVE_ID_KEY} from a config you copied)"
        )
    found_tables, found_layers = set(), set()
    for file, names in files.items():
        path = os.path.join(folder, file)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path} is missing: {index_name} lists it as holding {len(names)} tensor(s), "
                f"among them {sorted(names)[0]}"
            )
        header, metadata = _read_header(path)
        file_id = metadata.get(SAVE_ID_KEY)
        torn = None
        if names is not None and file_id != save_id:
            torn = ValueError(
                f"incomplete save: {path} belongs to another save (stem_save_id {file_id}) than {index_name} "
                f"(stem_save_id {save_id}): a save into {folder} was interrupted between its renames; re-run "
                "save_pretrained"
            )
            if file_id is not None:  # a save wrote it, and not the one that wrote the index: nothing else matters
                raise torn
        for name in names or ():
            if name not in header:
                raise ValueError(f"{path} lacks tensor {name}, which {index_name} says it holds")
        found_tables.update(_check_tables(path, header, config))
        found_layers.update(_check_dense(path, header, config))
        if torn is not None:  # a file without an id among a save's: replaced by hand, or by a save before save ids
            raise torn
    missing = sorted(set(config.stem_layers) - found_tables)
    if missing:
        raise ValueError(
            f"{folder}: the config lists STEM layer {missing[0]} but no file holds its table (stem_tables.{missing[0]}"
            f".weight); STEM layers without a table: {missing}"
        )
    _check_layer_count(folder, found_layers, config)
    return save_id


def _config_save_id(folder: str | os.PathLike) -> str | None:
    path = os.path.join(folder, CONFIG_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):  # no config, or one transformers will report
        return None
    return config.get(SAVE_ID_KEY) if isinstance(config, dict) else None


def unsaved_id() -> str:
    """A save id no save has: what a model whose weights changed since its last load or save carries, so that results
    evaluated on it are tied to no checkpoint (a record without any id would count as tied to every one)."""
    return f"unsaved-{uuid.uuid4().hex}"


def read_save_id(folder: str | os.PathLike, variant: str | None = None) -> str | None:
    """The save id recorded in `folder`'s index (of `variant`); None where there is no index or it records none."""
    path = os.path.join(folder, variant_name(SAFE_WEIGHTS_INDEX_NAME, variant))
    if not os.path.isfile(path):
        return None
    return (read_index(path).get("metadata") or {}).get(SAVE_ID_KEY)


def folder_save_ids(folder: str | os.PathLike) -> set[str | None]:
    """The save id of every safetensors index in `folder`, the default one and each variant's."""
    ids = set()
    for entry in os.listdir(folder) if os.path.isdir(folder) else ():
        match = _ANY_INDEX.fullmatch(entry)
        if match is not None:
            try:
                ids.add(read_save_id(folder, match.group(1)))
            except (OSError, ValueError):  # a broken index is the load's to report
                continue
    return ids


def stamp_safetensors(path: str, metadata: dict[str, str]) -> None:
    """Adds `metadata` to the header of a safetensors file written by someone else (transformers' dense shards): a new
    file with the grown header, the tensor bytes copied after it in the kernel (shared, not copied, on file systems
    with reflinks), then renamed over the old one."""
    _read_header(path)  # a file that is not whole gets no stamp
    with open(path, "rb") as src:
        (old_size,) = struct.unpack("<Q", src.read(8))
        header = json.loads(src.read(old_size))
        header["__metadata__"] = {**(header.get("__metadata__") or {}), **metadata}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keeps the tensor bytes 8-byte aligned, as safetensors writes them
        tmp = path + ".stamp"
        with open(tmp, "wb") as dst:
            dst.write(struct.pack("<Q", len(raw)) + raw)
            dst.flush()
            start, length = 8 + old_size, os.path.getsize(path) - 8 - old_size
            copied = 0
            try:
                while copied < length:
                    n = os.copy_file_range(src.fileno(), dst.fileno(), length - copied, start + copied)
                    if n == 0:
                        break
                    copied += n
            except (AttributeError, OSError):  # no copy_file_range here, or not between these files
                pass
            if copied < length:
                src.seek(start + copied)
                dst.seek(8 + len(raw) + copied)
                shutil.copyfileobj(src, dst, 16 << 20)
    os.replace(tmp, path)


# safetensors' names of the dtypes tables and offload stores are written in.
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8",
}  # fmt: skip
# Rows copied per write: what a save of a table larger than memory holds at a time.
WRITE_BLOCK_BYTES = 64 << 20
# The largest table file a save writes, whatever `max_shard_size` says: safetensors' loader maps each file
# copy-on-write, and Linux refuses such a map when it is larger than the host's memory: one file of every table of a
# large model would not load.
TABLE_SHARD_BYTES = 5 * 10**9


def block_rows(tensor_shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, block_bytes: int | None = None) -> int:
    """Rows of a tensor of `tensor_shape` that make about `block_bytes` (default `WRITE_BLOCK_BYTES`) in `dtype`, at
    least one."""
    block_bytes = WRITE_BLOCK_BYTES if block_bytes is None else block_bytes
    return max(1, block_bytes // max(1, math.prod(tensor_shape[1:]) * dtype.itemsize))


class StemSafetensorsWriter:
    """A safetensors file written in place, so that no tensor is ever held whole: the header first, as safetensors
    writes it (tensors in name order, their bytes back to back, the header padded with spaces to 8 bytes), then rows
    at their offsets in any order, by `write`. The file has its full size from the start. Single-dtype files only
    (tables, offload stores), which is what makes safetensors' own order the name order."""

    def __init__(self, path: str, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, metadata: dict[str, str]):
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: no safetensors name for dtype {dtype}")
        entries, size = {}, 0
        for name in sorted(shapes):
            nbytes = math.prod(shapes[name]) * dtype.itemsize
            entries[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(shapes[name]),
                "data_offsets": [size, size + nbytes],
            }
            size += nbytes
        header = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        self.path, self.dtype, self.shapes = path, dtype, {name: tuple(shape) for name, shape in shapes.items()}
        self.begin = {name: 8 + len(header) + entry["data_offsets"][0] for name, entry in entries.items()}
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), 0o666)
        try:
            self._pwrite(struct.pack("<Q", len(header)) + header, 0)
            os.ftruncate(self.fd, 8 + len(header) + size)
        except BaseException:
            self.close()
            raise

    def _pwrite(self, data: bytes | memoryview, offset: int) -> None:
        data = memoryview(data)
        while len(data):  # one call may write less than asked (Linux caps a call near 2 GiB)
            if hasattr(os, "pwrite"):
                written = os.pwrite(self.fd, data, offset)
            else:  # Windows: no positioned write; this writer is not shared between threads
                os.lseek(self.fd, offset, os.SEEK_SET)
                written = os.write(self.fd, data)
            data, offset = data[written:], offset + written

    def write(self, name: str, first_row: int, rows: torch.Tensor) -> None:
        """Writes `rows` (cast to the file's dtype) as rows `first_row...` of tensor `name`."""
        shape = self.shapes[name]
        if tuple(rows.shape[1:]) != shape[1:] or not 0 <= first_row <= first_row + len(rows) <= shape[0]:
            raise ValueError(
                f"{self.path}: rows of shape {list(rows.shape)} at row {first_row} do not fit {name} of shape "
                f"{list(shape)}"
            )
        data = rows.detach().to("cpu", self.dtype).contiguous().view(-1).view(torch.uint8).numpy()
        self._pwrite(data, self.begin[name] + first_row * math.prod(shape[1:]) * self.dtype.itemsize)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "StemSafetensorsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def table_shards(
    shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, max_shard_size: int | str, variant: str | None = None
) -> dict[str, list[str]]:
    """The table files a save writes, `{file: [table names]}`: tables in layer order, packed greedily into files of
    at most `max_shard_size` bytes and never more than `TABLE_SHARD_BYTES` (a table larger than that gets a file of its
    own), named as transformers names shards."""
    limit = _transformers_name("transformers.utils.hub", "convert_file_size_to_int")(max_shard_size)
    limit = min(limit, TABLE_SHARD_BYTES)
    shards, size = [[]], 0
    for name in sorted(shapes, key=lambda n: int(TABLE_KEY.search(n).group(1))):
        nbytes = math.prod(shapes[name]) * dtype.itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    shards = [names for names in shards if names]
    return {_shard_name(TABLES_NAME, variant, i, len(shards)): names for i, names in enumerate(shards, start=1)}


def table_metadata(save_id: str | None) -> dict[str, str]:
    """The metadata of a table file of save `save_id`."""
    return {"format": "pt", **({SAVE_ID_KEY: save_id} if save_id else {})}


def save_tables(
    tables: dict[str, torch.Tensor],
    folder: str,
    dtype: torch.dtype,
    max_shard_size: int | str,
    save_id: str | None = None,
    variant: str | None = None,
) -> dict:
    """Writes the tables in `dtype` to `stem-tables[.VARIANT]-XXXXX-of-YYYYY.safetensors` files (`table_shards`), each
    stamped with `save_id`, a block of rows at a time: a table is never cast or copied whole, so memory-mapped tables
    larger than memory save too. Returns their weight map."""
    shapes = {name: tuple(tensor.shape) for name, tensor in tables.items()}
    files = table_shards(shapes, dtype, max_shard_size, variant)
    weight_map = {}
    for file, names in logging.tqdm(files.items(), desc="Writing STEM tables", disable=not files):
        with StemSafetensorsWriter(
            os.path.join(folder, file), {n: shapes[n] for n in names}, dtype, table_metadata(save_id)
        ) as writer:
            for name in names:
                table, step = tables[name].detach(), block_rows(shapes[name], dtype)
                for start in range(0, len(table), step):
                    writer.write(name, start, table[start : start + step])
        weight_map.update(dict.fromkeys(names, file))
    return weight_map


def finish_checkpoint(
    folder: str,
    tables: dict[str, torch.Tensor],
    dtype: torch.dtype,
    max_shard_size,
    total_parameters: int,
    variant: str | None = None,
    save_id: str | None = None,
    written: dict[str, str] | None = None,
) -> str:
    """Adds the tables to a folder where transformers saved the dense weights (of `variant`), stamps every weight file
    with the save id (default: a fresh one), and writes one index for all files, with that id. Returns the id.
    `written`: the weight map of tables already in the folder, written with `save_id` (by a conversion that streams
    them there); `tables` is then not written."""
    if written is not None and save_id is None:
        raise ValueError("finish_checkpoint: tables already written carry a save id; pass it")
    save_id = save_id or uuid.uuid4().hex
    index_path = os.path.join(folder, variant_name(SAFE_WEIGHTS_INDEX_NAME, variant))
    if os.path.isfile(index_path):
        weight_map = read_index(index_path)["weight_map"]
    else:
        # An index beside `model.safetensors` would be ignored: transformers loads the single file first.
        dense = _shard_name(SAFE_WEIGHTS_NAME, variant, 1, 1)
        os.rename(os.path.join(folder, variant_name(SAFE_WEIGHTS_NAME, variant)), os.path.join(folder, dense))
        weight_map = dict.fromkeys(read_safetensors_header(os.path.join(folder, dense)), dense)
    # transformers writes its shards with no say over their metadata: the id goes in afterwards. The dense bytes are
    # copied once more, within the staging folder, which is what telling a torn save apart at load costs.
    for file in set(weight_map.values()):
        stamp_safetensors(os.path.join(folder, file), {SAVE_ID_KEY: save_id})
    # The config too: a commit killed after config.json went in, under an old index whose files the new save does not
    # replace (other shard names), would otherwise pair the new config with the old weights.
    config_path = os.path.join(folder, CONFIG_NAME)
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
        config[SAVE_ID_KEY] = save_id
        with open(config_path, "w", encoding="utf-8") as f:
            f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weight_map.update(
        written if written is not None else save_tables(tables, folder, dtype, max_shard_size, save_id, variant)
    )
    total_size = 0
    for file in set(weight_map.values()):
        total_size += sum(
            e["data_offsets"][1] - e["data_offsets"][0]
            for e in read_safetensors_header(os.path.join(folder, file)).values()
        )
    index = {
        "metadata": {"total_parameters": total_parameters, "total_size": total_size, SAVE_ID_KEY: save_id},
        "weight_map": dict(sorted(weight_map.items())),
    }
    with open(index_path, "w") as f:
        f.write(json.dumps(index, indent=2) + "\n")
    return save_id


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


def _flock(path: str, exclusive: bool, wait_message: str | None = None) -> int | None:
    """Holds a lock on the folder `path` for as long as the returned descriptor is open; the kernel drops it when the
    process dies. Without `wait_message`, returns None at once where another process holds a conflicting lock; with
    it, logs the message and waits. None where locks are not available (no fcntl, a file system without flock)."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    try:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if wait_message is None:
                raise
            logger.warning(wait_message)
            fcntl.flock(fd, mode)
    except OSError:
        os.close(fd)
        return None
    return fd


def _lock(folder: str) -> int | None:
    """An exclusive lock on a staging folder, which tells a later save a killed save's folder from a running one's."""
    return _flock(folder, exclusive=True)


def _snapshot(folder: str, variant: str | None) -> dict[str, tuple[int, ...]]:
    """Identity and state of each file a load of `variant` reads in `folder` (configs, index, weight files): a save
    replaces files by rename (a new inode), a copy over one rewrites it (a new size or mtime); either changes this."""
    weight_files, files = _weight_files(variant), {}
    for entry in os.scandir(folder):
        if entry.name in (CONFIG_NAME, "generation_config.json") or weight_files.fullmatch(entry.name):
            try:
                st = entry.stat()
            except OSError:  # a dangling link: the load reports it
                continue
            files[entry.name] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return files


@contextmanager
def reading_checkpoint(
    path: str | os.PathLike | None, subfolder: str = "", variant: str | None = None
) -> Iterator[None]:
    """Reads of a local checkpoint folder inside this (its checks and transformers' load) see the files of one save,
    or fail: they hold a shared lock on the folder, which a save's commit waits for (and a load that meets a commit
    waits for it), and they fail if a checkpoint file changed meanwhile (a writer that does not take the lock, or a
    file system without flock)."""
    folder = os.path.join(os.fspath(path), subfolder) if path is not None else ""
    if not os.path.isdir(folder):  # a Hub id: the Hub's snapshot of one revision
        yield
        return
    lock = _flock(folder, exclusive=False, wait_message=f"{folder}: waiting for a save into it to finish its renames")
    try:
        before = _snapshot(folder, variant)
        yield
        after = _snapshot(folder, variant)
        changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
        if changed:
            raise RuntimeError(
                f"{folder}: {', '.join(changed)} changed while the checkpoint was read (a save or copy into the folder "
                "ran meanwhile without stem-hf's lock), so what was read may mix two saves; run it again once the "
                "writer is done"
            )
    finally:
        if lock is not None:
            os.close(lock)


@contextmanager
def commit_lock(target: str | os.PathLike) -> Iterator[None]:
    """An exclusive lock on the folder `target` while a save (or `stem-hf refresh-code`) renames files into it: loads
    in progress finish first, and loads that start meanwhile wait (`reading_checkpoint`)."""
    lock = _flock(target, exclusive=True, wait_message=f"{target}: waiting for loads of it to finish before the save")
    try:
        yield
    finally:
        if lock is not None:
            os.close(lock)


def _abandoned(folder: str) -> bool:
    """Whether a staging folder was left by a save that no longer runs: no process holds its lock and it is over a
    minute old (a save that has just made it may not hold the lock yet). Where no lock can tell, only after a day."""
    age = time.time() - os.lstat(folder).st_mtime
    if age < _STALE_AFTER_S:
        return False
    try:
        import fcntl

        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):
        return age > _STALE_UNLOCKED_AFTER_S
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return age > _STALE_UNLOCKED_AFTER_S
    finally:
        os.close(fd)
    return True


def _remove_abandoned_staging(target: str) -> None:
    """Removes the staging folders of killed saves to `target`: inside it (any `.stem-saving-*` folder: the target's
    own), and beside it those named for it. Files, other targets' folders and running saves' folders stay."""
    parent, name = os.path.split(target)
    beside = re.compile(re.escape(f"{_STAGING_PREFIX}{name}-") + r"[0-9a-f]{12}")
    candidates = [os.path.join(parent, entry) for entry in os.listdir(parent) if beside.fullmatch(entry)]
    if os.path.isdir(target):
        candidates += [os.path.join(target, e) for e in os.listdir(target) if e.startswith(_STAGING_PREFIX)]
    for path in candidates:
        if os.path.isdir(path) and not os.path.islink(path) and _abandoned(path):
            logger.warning(f"removing {path}, left by a save that was killed before it finished")
            shutil.rmtree(path, ignore_errors=True)


@contextmanager
def staged_folder(target: str | os.PathLike, variant: str | None = None) -> Iterator[str]:
    """Yields an empty folder beside `target` to save into, then commits it: a new `target` appears in one rename; an
    existing one gets each file replaced by rename (weight files first, the index of `variant` last) and stale weight
    files of `variant` removed. Every byte is on disk before the first rename, and nothing in `target` is touched if
    the save fails. A commit killed between its renames leaves weight files whose save id differs from the index's,
    which `check_checkpoint_files` refuses; the staging folders of killed saves are removed by the next save. The
    renames into an existing `target` hold its `commit_lock`, which loads wait for, so no load sees them half done."""
    target = os.path.abspath(target)
    if os.path.isfile(target):
        raise NotADirectoryError(f"{target} is a file; save_pretrained needs a folder")
    if os.path.islink(target) and not os.path.exists(target):
        raise FileNotFoundError(
            f"{target} is a symbolic link to {os.readlink(target)}, which does not exist: create that folder, or "
            "remove the link to save into a new folder in its place"
        )
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    _remove_abandoned_staging(target)
    # Stage inside an existing target (same filesystem even if it is a mount point), beside a new one, named for it so
    # that the next save to it can clean up after a killed one.
    if os.path.isdir(target):
        staging = os.path.join(target, _STAGING_PREFIX + secrets.token_hex(6))
    else:
        staging = os.path.join(parent, f"{_STAGING_PREFIX}{os.path.basename(target)}-{secrets.token_hex(6)}")
    umask = os.umask(0)
    os.umask(umask)
    os.mkdir(staging)  # with the usual permissions: a new checkpoint is this folder
    lock = _lock(staging)
    try:
        yield staging
        for name in os.listdir(staging):
            _fsync(os.path.join(staging, name))
        if not os.path.exists(target):
            os.rename(staging, target)
        else:
            with commit_lock(target):
                _replace_files(staging, target, variant, umask)
        _fsync(parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if lock is not None:
            os.close(lock)


def _replace_files(staging: str, target: str, variant: str | None, umask: int) -> None:
    """Moves a staged save's files into the existing folder `target` by rename, weight files first and the index
    last, and removes the weight files of `variant` that the save does not have."""
    new = os.listdir(staging)
    weight_files = _weight_files(variant)
    index_name = variant_name(SAFE_WEIGHTS_INDEX_NAME, variant)
    single = variant_name(SAFE_WEIGHTS_NAME, variant)
    stale = [f for f in os.listdir(target) if weight_files.fullmatch(f) and f not in new]
    for name in new:  # files mkstemp-like writers made private get the usual permissions too
        os.chmod(os.path.join(staging, name), 0o666 & ~umask)
    # Weight files first: once one is in, the old index no longer matches and a kill is caught at load; the
    # config and code follow, so they never change under old weights.
    for name in sorted(new, key=lambda f: (f == index_name, not weight_files.fullmatch(f), f)):
        if name == index_name and single in stale:
            # transformers would load a stale single file in preference to the new index.
            os.remove(os.path.join(target, single))
            stale.remove(single)
        os.replace(os.path.join(staging, name), os.path.join(target, name))
    for name in stale:
        os.remove(os.path.join(target, name))


# Loading --------------------------------------------------------------------------------------------------------

# What `from_pretrained` passes on to read a config from the Hub.
_CONFIG_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")
# Config fields that give the saved tensors their shapes: a load cannot change them.
_FIXED_AT_SAVE = ("stem_layers", "vocab_size", "intermediate_size", "hidden_size", "num_hidden_layers")


def _refuse_shape_overrides(config, kwargs: dict) -> None:
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


def prepare_load(model_class: type, path, kwargs: dict) -> str | None:
    """What `from_pretrained` does before transformers loads: refuses shape overrides, checks a local checkpoint's
    files (a missing shard, a truncated or corrupt file, a table whose shape disagrees with the config raise an error
    naming the file and tensor), and rewrites a `device_map` so that it leaves the tables in host memory. Edits
    `kwargs` in place; returns the local checkpoint's save id (None for a Hub id)."""
    if path is None:
        return None
    folder = os.path.join(os.fspath(path), kwargs.get("subfolder", ""))
    device_map = kwargs.get("device_map")
    if not (os.path.isdir(folder) or device_map is not None or any(name in kwargs for name in _FIXED_AT_SAVE)):
        return None
    config_class = model_class.config_class
    config = kwargs.get("config")
    if getattr(config, "model_type", None) != config_class.model_type:
        # The config from_pretrained will build: the saved one with the caller's overrides applied.
        fields = {f.name for f in dataclasses.fields(config_class)} - set(_FIXED_AT_SAVE)
        overrides = {k: v for k, v in kwargs.items() if k in fields or k in _CONFIG_KWARGS}
        config = config_class.from_pretrained(path, **overrides)
    _refuse_shape_overrides(config, kwargs)
    save_id = None
    if os.path.isdir(folder):
        save_id = check_checkpoint_files(folder, config, kwargs.get("variant"))
    if device_map is not None and config.keep_tables_on_cpu and config.stem_layers:
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        kwargs["device_map"] = device_map_keeping_tables_on_cpu(
            model_class, config, device_map, kwargs.get("max_memory"), dtype
        )
    return save_id


def load_checkpoint(model_class: type, load: Callable, path: str | os.PathLike | None, *model_args, **kwargs):
    """`from_pretrained` of a STEM model: `load` (transformers' own) after `prepare_load`'s checks, both under
    `reading_checkpoint`, so that a local folder is read as the files of one save; then `finish_load`."""
    with reading_checkpoint(path, kwargs.get("subfolder", ""), kwargs.get("variant") or None):
        save_id = prepare_load(model_class, path, kwargs)
        loaded = load(path, *model_args, **kwargs)
    finish_load(loaded[0] if isinstance(loaded, tuple) else loaded, save_id)  # a tuple: output_loading_info
    return loaded


def device_map_keeping_tables_on_cpu(
    model_class: type, config, device_map, max_memory: dict | None = None, dtype: torch.dtype | str | None = None
) -> dict:
    """The device map transformers would use, with no entry that covers a table. Parameters outside the map load on
    CPU and get no accelerate hook, so the tables stay in host memory (memory-mapped) and each forward moves only the
    rows it needs; a "cpu" entry would instead copy the whole table to the accelerator at every forward."""
    # Private helpers of transformers: what placing the dense part exactly as transformers would takes. Its own
    # `_no_placement_params` (set on StemModel) is no substitute: it only lets a no-split module that fits nowhere
    # leave those parameters out, and explicit maps ({"": 0}, "cuda:0") would still move every table.
    get_device_map = _transformers_name("transformers.integrations.accelerate", "_get_device_map")
    check_and_set_device_map = _transformers_name("transformers.integrations.accelerate", "check_and_set_device_map")
    if dtype is None or dtype == "auto":
        dtype = config.dtype or torch.float32
    with torch.device("meta"):
        model = model_class(config).to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)  # sizes the map
    tables = model.base_model.stem_tables
    tables_name = next(name for name, module in model.named_modules() if module is tables)
    device_map = check_and_set_device_map(device_map)
    if isinstance(device_map, str):  # "auto", "balanced", ...: place the model as if it had no tables
        for key in list(tables.keys()):
            del tables[key]
        device_map = get_device_map(model, device_map, max_memory, None)
    device_map = {k: v for k, v in device_map.items() if k != tables_name and not k.startswith(tables_name + ".")}
    modules = dict(model.named_modules())
    while (covering := next((k for k in device_map if k == "" or tables_name.startswith(k + ".")), None)) is not None:
        device = device_map.pop(covering)
        prefix = f"{covering}." if covering else ""
        parent = modules[covering]
        children = [name for name, _ in parent.named_children()]
        children += [name for name, _ in parent.named_parameters(recurse=False)]
        children += [name for name, _ in parent.named_buffers(recurse=False)]
        device_map.update({prefix + name: device for name in children if prefix + name != tables_name})
    return device_map


def finish_load(model, save_id: str | None) -> None:
    """Records which save of the folder's weights `model` holds (provenance files beside them are matched against it,
    not against whatever a later save left in the folder) and advises the kernel that tables are read at random."""
    model.stem_save_id = save_id
    for table in model.base_model.stem_tables.values():
        advise_random_access(table.weight)


# Saving ---------------------------------------------------------------------------------------------------------


def _split_state_dict(model, state_dict: dict | None) -> tuple[dict, dict]:
    """(tables, dense) of `state_dict` (default: the model's), refusing tables offloaded to disk or freed."""
    if state_dict is None:
        state_dict = model.state_dict()
    tables = {name: tensor for name, tensor in state_dict.items() if TABLE_KEY.search(name)}
    dense = {name: tensor for name, tensor in state_dict.items() if name not in tables}
    offloaded = [name for name, tensor in tables.items() if tensor.device.type == "meta"]
    if offloaded:
        raise ValueError(
            f"{offloaded[0]} is offloaded to disk (on the meta device) and cannot be saved: load the model with "
            "keep_tables_on_cpu=True (the default) or without a 'disk' entry for the tables in device_map"
        )
    freed = [name for name, tensor in tables.items() if tensor.shape[0] == 0]
    if freed:
        raise ValueError(f"{freed[0]} cannot be saved: {FREED_TABLES}")
    return tables, dense


def held_table_dtype(tables: Iterable[torch.Tensor]) -> str | None:
    """The table dtype all of `tables` are held in (float32 once trained, whatever the config says); None if they
    differ (some trained, some frozen) or none is a table dtype."""
    held = {str(t.dtype).removeprefix("torch.") for t in tables}
    return held.pop() if len(held) == 1 and next(iter(held)) in TABLE_DTYPES else None


def saved_table_dtype(model, tables: dict[str, torch.Tensor], table_dtype: str | torch.dtype | None = None) -> str:
    """The dtype a save writes the tables in: `table_dtype` if the caller names one; else the tables' own where they
    share one (float32 after training, which upcasts trainable tables: a save keeps every update); else, with tables
    in different dtypes (some trained, some frozen), `config.table_dtype`, with a warning that it rounds the finer."""
    if table_dtype is not None:
        return check_table_dtype(str(table_dtype).removeprefix("torch."))
    held = held_table_dtype(tables.values())
    if held is not None:
        return held
    stored = model.config.torch_table_dtype
    finer = sorted({str(t.dtype)[6:] for t in tables.values() if t.itemsize > stored.itemsize})
    if finer:
        logger.warning_once(
            f"tables held in {', '.join(finer)} (trained: train() upcasts them) are saved in config.table_dtype "
            f"{model.config.table_dtype}, which rounds away updates smaller than its spacing; "
            "save_pretrained(..., table_dtype='float32') keeps every update, in twice the bytes"
        )
    return model.config.table_dtype


def write_checkpoint(
    model,
    folder: str,
    save_dense: Callable,
    state_dict: dict | None = None,
    max_shard_size: int | str = "50GB",
    save_id: str | None = None,
    written: dict[str, str] | None = None,
    table_dtype: str | torch.dtype | None = None,
    **kwargs,
) -> str:
    """What `save_checkpoint` writes into its staging `folder`: config, code and dense weights by `save_dense`
    (transformers' own), the tables (in `saved_table_dtype`), one index. `save_id` and `written` as
    `finish_checkpoint` takes them: a conversion that streamed its tables into `folder` passes their weight map.
    Returns the save id, which the model then records as that of the weights it holds."""
    variant = kwargs.pop("variant", None) or None
    tables, dense = _split_state_dict(model, state_dict)
    # Tables a conversion streamed into `folder` are in config.table_dtype already.
    dtype = model.config.table_dtype if written is not None else saved_table_dtype(model, tables, table_dtype)
    # So that AutoModel.from_pretrained(..., trust_remote_code=True) finds the base model too.
    if model._auto_class is not None:
        auto_map = getattr(model.config, "auto_map", None) or {}
        model.config.auto_map = {**auto_map, "AutoModel": "modeling_stem.StemModel"}
    chosen, model.config.table_dtype = model.config.table_dtype, dtype  # config.json records what the files hold
    try:
        save_dense(folder, state_dict=dense, max_shard_size=max_shard_size, variant=variant, **kwargs)
    finally:
        model.config.table_dtype = chosen  # the model's config stays what its user set
    save_id = finish_checkpoint(
        folder, tables, getattr(torch, dtype), max_shard_size, model.num_parameters(), variant, save_id, written
    )
    model.stem_save_id = save_id  # the weights in memory are now those of this save
    return save_id


def save_checkpoint(
    model,
    save_directory: str | os.PathLike,
    save_dense: Callable,
    state_dict: dict | None = None,
    push_to_hub: bool = False,
    max_shard_size: int | str = "50GB",
    **kwargs,
) -> str:
    """`save_pretrained` of a STEM model: `save_dense` (transformers' own) writes config, code and dense weights, and
    the tables go to their own `stem-tables-XXXXX-of-YYYYY.safetensors` files (in `saved_table_dtype`, at most
    `max_shard_size` each) listed with the dense shards in one `model.safetensors.index.json`. The save is staged in a
    hidden folder (beside a new `save_directory`, inside an existing one) and committed by renames, so an interrupted
    save never leaves half-written files in place of a good checkpoint; every weight file and the index, written last,
    carry one fresh save id, so that a save killed between its renames is refused at load rather than loaded as a mix
    of two saves. With `variant` ("fp16"), files are named as transformers names a variant's. Last, the package's card
    hook (`write_card`) names provenance files of an earlier save and writes the card. Returns the save id."""
    variant = kwargs.get("variant") or None
    check_variant(variant)
    hub_kwargs = {k: kwargs.pop(k) for k in ("repo_id", "commit_message", "create_pr", "private") if k in kwargs}
    with staged_folder(save_directory, variant) as staging:
        save_id = write_checkpoint(model, staging, save_dense, state_dict, max_shard_size, **kwargs)
    write_card(model, save_directory)
    if push_to_hub:
        repo_id = hub_kwargs.pop("repo_id", os.path.basename(os.path.abspath(save_directory)))
        model.push_to_hub(repo_id, max_shard_size=max_shard_size, token=kwargs.get("token"), **hub_kwargs)
    return save_id


def write_card(model, folder: str | os.PathLike, repo_id: str | None = None, tags: list[str] | None = None) -> None:
    """Writes or refreshes `README.md` with the model's card writer (set when stem_hf is installed); never replaces a
    card a person wrote. A card that cannot be rendered is a warning: the weights are saved by then."""
    writer = getattr(model, "_model_card_writer", None)
    if writer is None:
        return
    try:
        writer(folder, repo_id=repo_id, tags=[*(model.model_tags or []), *(tags or [])])
    except Exception as err:  # noqa: BLE001 - a card is never worth failing a save that already succeeded
        logger.warning(f"no model card written to {folder}: {type(err).__name__}: {err}")


__all__ = [
    "CONFIG_NAME",
    "FREED_TABLES",
    "PROVENANCE_FILES",
    "REPORT_FILE",
    "RESULTS_FILE",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SAVE_ID_KEY",
    "TABLE_KEY",
    "StemSafetensorsWriter",
    "TABLES_NAME",
    "TABLE_SHARD_BYTES",
    "WRITE_BLOCK_BYTES",
    "advise_random_access",
    "block_rows",
    "check_checkpoint_files",
    "check_variant",
    "commit_lock",
    "device_map_keeping_tables_on_cpu",
    "finish_checkpoint",
    "finish_load",
    "load_checkpoint",
    "prepare_load",
    "read_safetensors_header",
    "read_safetensors_metadata",
    "read_index",
    "SAFETENSORS_DTYPES",
    "folder_save_ids",
    "held_table_dtype",
    "read_save_id",
    "saved_table_dtype",
    "reading_checkpoint",
    "save_checkpoint",
    "save_tables",
    "staged_folder",
    "stamp_safetensors",
    "table_metadata",
    "table_shards",
    "unsaved_id",
    "variant_name",
    "write_checkpoint",
    "write_card",
]
