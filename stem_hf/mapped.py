"""Safetensors files as copy-on-write memory maps, for the package's own readers: the offload store, a conversion's
streamed tables, `stem-hf verify`. Not remote code: a loaded checkpoint's tables are mapped by transformers."""

import mmap
import os
import platform
import struct
import sys

import torch

from .checkpoint_stem import SAFETENSORS_DTYPES, read_safetensors_header

TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}

# Python's mmap module names MAP_NORESERVE only from 3.13 on; Linux's value, which a few architectures change.
_LINUX_MAP_NORESERVE = {"ppc": 0x40, "ppc64": 0x40, "ppc64le": 0x40, "sparc": 0x40, "sparc64": 0x40}.get(
    platform.machine(), 0x400 if platform.machine().startswith("mips") else 0x4000
)


def _private_map(fileno: int) -> mmap.mmap:
    """A copy-on-write map of a whole file. Linux charges a writable private map against memory when it is made and
    refuses one larger than RAM unless told not to reserve (`MAP_NORESERVE`): pages are copied only when written."""
    if os.name == "nt":
        return mmap.mmap(fileno, 0, access=mmap.ACCESS_COPY)
    noreserve = getattr(mmap, "MAP_NORESERVE", _LINUX_MAP_NORESERVE if sys.platform.startswith("linux") else 0)
    return mmap.mmap(fileno, 0, flags=mmap.MAP_PRIVATE | noreserve, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def map_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a copy-on-write memory map of it (after `read_safetensors_header`'s
    checks): pages are read in as they are used, and a write to a tensor copies the pages it touches instead of
    altering the file."""
    header = read_safetensors_header(path)
    with open(path, "rb") as f:
        (header_size,) = struct.unpack("<Q", f.read(8))
        data = header_size + 8
        buffer = _private_map(f.fileno()) if os.path.getsize(path) > data else None
    tensors = {}
    for name, entry in header.items():
        dtype = TORCH_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} is {entry['dtype']}, which this reader does not map")
        begin, end = entry["data_offsets"]
        if end == begin:
            tensors[name] = torch.empty(entry["shape"], dtype=dtype)
            continue
        flat = torch.frombuffer(buffer, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=data + begin)
        tensors[name] = flat.view(entry["shape"])
    return tensors


__all__ = ["TORCH_DTYPES", "map_safetensors"]
