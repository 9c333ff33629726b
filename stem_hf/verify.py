"""`stem-hf verify`: what a load checks in a local STEM checkpoint (config, index, headers, shapes, dtypes, save ids,
layer counts), plus what it cannot check without reading every byte: non-finite values in any weight. safetensors has
no checksums, so bytes overwritten with finite garbage still pass; a row of NaN or inf does not."""

import os

import torch
from tqdm import tqdm

from .accounting import load_config
from .checkpoint_stem import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    check_checkpoint_files,
    read_index,
    reading_checkpoint,
)
from .mapped import map_safetensors

# Rows read at a time: a table's scan never holds more than this many bytes of it in a temporary.
SCAN_BYTES = 64 * 2**20


def weight_files(folder: str) -> list[str]:
    """The safetensors files a load of `folder` reads: the single file, or every file its index names."""
    if os.path.isfile(os.path.join(folder, SAFE_WEIGHTS_NAME)):
        return [SAFE_WEIGHTS_NAME]
    index = os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME)
    if not os.path.isfile(index):
        raise FileNotFoundError(
            f"{folder} holds no safetensors weights ({SAFE_WEIGHTS_INDEX_NAME} or {SAFE_WEIGHTS_NAME})"
        )
    return sorted(set(read_index(index)["weight_map"].values()))


def non_finite_rows(tensor: torch.Tensor, limit: int = 5) -> tuple[int, list[int]]:
    """(non-finite values in `tensor`, the first `limit` row indices holding one), read a block of rows at a time."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return 0, []
    rows = tensor.reshape(tensor.shape[0], -1) if tensor.dim() > 1 else tensor.reshape(-1, 1)
    step = max(1, SCAN_BYTES // max(1, rows.shape[1] * rows.element_size()))
    count, first = 0, []
    for start in range(0, rows.shape[0], step):
        block = rows[start : start + step]
        bad = ~torch.isfinite(block.float() if block.element_size() == 1 else block)  # no isfinite for float8
        per_row = bad.sum(dim=1)
        count += int(per_row.sum())
        if len(first) < limit:
            first += (per_row.nonzero().flatten() + start).tolist()[: limit - len(first)]
    return count, first


def verify_checkpoint(folder: str | os.PathLike) -> dict:
    """Checks a local STEM checkpoint as a load does, then scans every weight for NaN and inf. Returns
    `{"tensors": n, "bytes": n, "non_finite": {tensor: {"count": n, "rows": [first rows]}}}`; raises what a load
    would raise on a broken file."""
    folder = os.fspath(folder)
    report = {"tensors": 0, "bytes": 0, "non_finite": {}}
    with reading_checkpoint(folder):
        check_checkpoint_files(folder, load_config(folder, hub=False))
        files = weight_files(folder)
        tensors = {}
        for file in files:
            tensors.update(map_safetensors(os.path.join(folder, file)))
    for name, tensor in tqdm(sorted(tensors.items()), desc="Scanning weights", unit="tensor", leave=False):
        report["tensors"] += 1
        report["bytes"] += tensor.numel() * tensor.element_size()
        count, rows = non_finite_rows(tensor)
        if count:
            report["non_finite"][name] = {"count": count, "rows": rows}
    return report


__all__ = ["non_finite_rows", "verify_checkpoint", "weight_files"]
