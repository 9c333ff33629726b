"""Offloaded STEM inference: tables stay in host memory, and each forward fetches only the rows its tokens need.

- `StemHostTables`: every STEM layer's table in one token-major host tensor `[vocab, n_stem_layers, d_ff]`, so that
  one token's rows for all layers are contiguous (one gather per token, not one per layer); optionally int8 with one
  fp32 scale per row (half the bytes of bf16). Only the staging buffers are pinned: pinning the whole store would lock
  (and round up) host memory the size of every table.
- `StemOffloadEngine`: per forward, deduplicates the batch's ids once, gathers the unique rows for all layers in one
  multithreaded gather (`gather_rows`: a memcpy per row, wide rows in pieces) into a pinned staging buffer (two, used in
  turn, so a gather never overwrites rows still being copied), copies them to the accelerator on a side stream, and
  hands each STEM layer its rows. On CUDA, a large forward without a row cache (a prefill) is fetched layer by layer
  instead, each layer's rows gathered and copied on a worker thread ahead of the layers that read them
  (`StemPipelinedRows`). A device-resident row cache (LFU, LRU among equals) keeps frequent tokens' rows so decode
  rarely fetches again. `plan(prompt, chunk_size)` announces a chunked prefill: while one chunk computes, a
  background thread gathers (and starts copying) the next chunk's rows into the other staging buffer.

- `StemMappedTables`: the same token-major layout as a file (`write_offload_store`, written once beside the checkpoint),
  memory-mapped instead of copied: the engine gathers from the map, so tables larger than memory serve, and host
  memory holds only the pages the kernel keeps cached.

It plugs into the model as its row source (`StemModel.set_row_source`), so `generate()` (greedy, sampling, batched,
with the KV cache) and `device_map` loads work unchanged. Without an accelerator
the same engine serves rows from host memory (no copy): the plain CPU gather path.
"""

import json
import math
import os
import struct
import warnings
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch
from torch import nn
from tqdm import tqdm

from .accounting import STORE_NAME, load_config
from .checkpoint_stem import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAVE_ID_KEY,
    TABLE_KEY,
    StemSafetensorsWriter,
    advise_random_access,
    block_rows,
    check_checkpoint_files,
    held_table_dtype,
    read_index,
    read_safetensors_header,
    read_safetensors_metadata,
    reading_checkpoint,
)
from .mapped import map_safetensors
from .modeling_stem import (
    StemLookup,
    check_token_ids,
    fetch_rows,
    gather_rows,
    layers_ahead,
    lookup_fuses,
    unwrapped_tables,
)
from .system import available_memory, check_disk_room

BUILD_ROWS = 4096  # vocabulary rows copied at a time while building the store
# On CUDA, a forward with at least this many distinct ids (a prefill) fetches its rows layer by layer, overlapped with
# the layers before (`StemPipelinedRows`); fewer (a decoding step) in one gather for every layer.
PIPELINE_MIN_IDS = 1024
# The one tensor in the mapped store's file (`STORE_NAME`, beside the weights): `[vocab, stem_layers, d_ff]`.
STORE_TENSOR = "rows"


class StemHostTables:
    """The token-major host store. `gather(ids)` returns `(rows, scales)`: `[n, layers, d_ff]` rows in the store dtype
    and, for int8, `[n, layers]` fp32 scales (else None)."""

    def __init__(self, tables: dict[int, torch.Tensor], dtype: torch.dtype | None = None, int8: bool = False):
        if not tables:
            raise ValueError("StemHostTables: the model has no STEM layers, so no tables to offload")
        self.layers = sorted(tables)
        shapes = {tuple(t.shape) for t in tables.values()}
        if len(shapes) != 1:
            raise ValueError(f"StemHostTables: tables of different shapes {sorted(shapes)}")
        (vocab, width), n = shapes.pop(), len(self.layers)
        self.vocab_size, self.width, self.int8 = vocab, width, int8
        self.table_dtype = dtype or next(iter(tables.values())).dtype  # what int8 rows are dequantized to
        dtype = torch.int8 if int8 else self.table_dtype
        needed, available = vocab * n * (width * dtype.itemsize + (4 if int8 else 0)), available_memory()
        if available is not None and needed > available:
            raise MemoryError(
                f"StemHostTables: a host copy of the tables takes {needed / 2**30:.1f} GiB and {available / 2**30:.1f} "
                "GiB of memory are available; serve them from a mapped store instead: write it once with `stem-hf "
                "offload-store CHECKPOINT` and pass StemOffloadEngine(model, store=PATH)"
            )
        self.data = torch.empty((vocab, n, width), dtype=dtype)
        self.scales = torch.empty((vocab, n), dtype=torch.float32) if int8 else None
        for start in tqdm(range(0, vocab, BUILD_ROWS), desc="STEM host tables", unit="block", leave=False):
            block = slice(start, min(start + BUILD_ROWS, vocab))
            for i, layer in enumerate(self.layers):
                self._put(block, i, tables[layer].detach()[block].to("cpu"))
        self.slot = {layer: i for i, layer in enumerate(self.layers)}

    def _put(self, index, slot: int, rows: torch.Tensor) -> None:
        """Stores `rows` (table rows, any float dtype) at `index` of layer slot `slot`: cast, or int8 with a scale."""
        if self.scales is None:
            self.data[index, slot] = rows.to(self.data.dtype)
            return
        rows = rows.float()
        scale = rows.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.data[index, slot] = torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.scales[index, slot] = scale

    def read(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s rows of `ids` as served: in float32, dequantized for int8."""
        rows = self.data[ids, self.slot[layer]].float()
        return rows if self.scales is None else rows * self.scales[ids, self.slot[layer], None]

    def write(self, layer: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Replaces layer `layer`'s rows of `ids` with `rows`, stored as the build stores them (cast, or int8)."""
        self._put(ids, self.slot[layer], rows.detach().to("cpu"))

    def restore(self, ids: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor | None) -> None:
        """Puts back rows (and scales) of `ids` exactly as `gather(ids)` returned them."""
        self.data[ids] = rows
        if scales is not None:
            self.scales[ids] = scales

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + (0 if self.scales is None else self.scales.numel() * 4)

    def row_bytes(self) -> int:
        """Bytes one token costs to fetch: its rows for every layer (and their scales)."""
        return self.nbytes // self.vocab_size

    def gather(self, ids: torch.Tensor, out: torch.Tensor | None = None, out_scales: torch.Tensor | None = None):
        rows = gather_rows(self.data, ids, out=out)
        scales = None if self.scales is None else torch.index_select(self.scales, 0, ids, out=out_scales)
        return rows, scales


def write_offload_store(folder: str | os.PathLike, path: str | os.PathLike | None = None) -> str:
    """Writes the token-major store of the STEM checkpoint in `folder` to `path` (default: `folder/STORE_NAME`) and
    returns its path: `[vocab, stem_layers, d_ff]` in the tables' dtype, one tensor of a safetensors file whose metadata
    names the layers and the checkpoint's save id. Built a block of rows at a time from the table shards, memory-mapped,
    so tables larger than memory are never held; written to a `.partial` file beside `path`, renamed when complete."""
    folder = os.fspath(folder)
    path = os.fspath(path) if path is not None else os.path.join(folder, STORE_NAME)
    if not path or os.path.isdir(path):
        raise ValueError(f"path: {path!r} is {'empty' if not path else 'a folder'}; give the store's file path")
    with reading_checkpoint(folder):  # the config and tables are those of the save the checks read
        config = load_config(folder, hub=False)
        if not config.stem_layers:
            raise ValueError(f"{folder}: the checkpoint has no STEM layers, so no tables to store")
        save_id = check_checkpoint_files(folder, config)
        tables = _map_tables(folder)
    layers, dtype = config.stem_layers, tables[config.stem_layers[0]].dtype
    if os.path.exists(path):
        _read_store_metadata(path)  # refuses to replace a file that is not an offload store
    shape = (config.vocab_size, len(layers), config.intermediate_size)
    metadata = {"format": "pt", "stem_layers": json.dumps(layers), **({SAVE_ID_KEY: save_id} if save_id else {})}
    # A store already at `path` stays until the new one, written beside it, replaces it: it does not count as room.
    check_disk_room(path, math.prod(shape) * dtype.itemsize, "the offload store takes")
    partial = path + ".partial"
    lock = os.open(partial, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        _lock_or_refuse(lock, partial)
        try:
            with StemSafetensorsWriter(partial, {STORE_TENSOR: shape}, dtype, metadata) as writer:
                step = block_rows(shape, dtype)
                for start in tqdm(range(0, shape[0], step), desc="STEM offload store", unit="block"):
                    block = torch.stack([tables[layer][start : start + step] for layer in layers], dim=1)
                    writer.write(STORE_TENSOR, start, block)
                os.fsync(writer.fd)
            os.replace(partial, path)
        except BaseException:
            os.remove(partial)  # as large as the tables: a failed or interrupted write leaves nothing behind
            raise
    finally:
        os.close(lock)
    return path


def _map_tables(folder: str) -> dict[int, torch.Tensor]:
    """Every table of a saved checkpoint, memory-mapped from its shard, by layer."""
    index_path = os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME)
    if not os.path.isfile(index_path):
        raise FileNotFoundError(f"{index_path} is missing: an offload store is built from a saved checkpoint")
    weight_map = read_index(index_path)["weight_map"]
    tables = {}
    for file in sorted({file for name, file in weight_map.items() if TABLE_KEY.search(name)}):
        for name, tensor in map_safetensors(os.path.join(folder, file)).items():
            if TABLE_KEY.search(name):
                tables[int(TABLE_KEY.search(name).group(1))] = tensor
    return tables


def _tensor_offset(path: str, name: str) -> int:
    """The byte offset in a safetensors file at which tensor `name`'s data begins."""
    with open(path, "rb") as f:
        (header_size,) = struct.unpack("<Q", f.read(8))
    return 8 + header_size + read_safetensors_header(path)[name]["data_offsets"][0]


def _lock_or_refuse(fd: int, path: str) -> None:
    try:
        import fcntl
    except ImportError:  # no locks here: a second writer is not detected
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise RuntimeError(f"{path}: another process is writing this offload store") from None


def _read_store_metadata(path: str) -> dict:
    """The metadata of an offload store file, after checking it is one and whole."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no offload store there; write one with `stem-hf offload-store CHECKPOINT`")
    metadata = read_safetensors_metadata(path)  # raises, naming the file, on a truncated or corrupt one
    if "stem_layers" not in metadata:
        raise ValueError(f"{path} is a safetensors file but not a STEM offload store (no stem_layers in its metadata)")
    return metadata


def _check_store_save(path: str, stored: str | None, save_id: str | None, allow_unverified: bool) -> None:
    """Refuses a store written from another save than the model's, and (unless `allow_unverified`) one whose save and
    the model's cannot be compared."""
    rewrite = "write the store again with `stem-hf offload-store CHECKPOINT` (write_offload_store)"
    unverified = "or pass allow_unverified=True if you know the store holds this model's tables"
    if save_id is not None and save_id.startswith("unsaved-"):
        problem = (
            f"the model's tables changed since its last load or save (trained or edited: save id {save_id}), so "
            f"{path}, written from a saved checkpoint, may not hold them: save the model (save_pretrained), {rewrite} "
            "from that save"
        )
    elif stored is None:
        problem = (
            f"{path} records no save id (written from a checkpoint saved before save ids), so nothing shows it holds "
            f"this model's tables: save the model again (save_pretrained records one) and {rewrite}"
        )
    elif save_id is None:
        problem = (
            "the model records no save id (it was not loaded from a saved checkpoint, or no save_id was passed), so "
            f"nothing shows {path} holds its tables: save the model, {rewrite} from that save, and load the model "
            "from it"
        )
    elif stored != save_id:
        raise ValueError(
            f"{path} was written from save {stored} of the checkpoint and the model holds save {save_id}: the tables "
            f"changed since; {rewrite}"
        )
    else:
        return
    if not allow_unverified:
        raise ValueError(f"{problem}; {unverified}")


class StemMappedTables:
    """The token-major store as a file (`write_offload_store`), memory-mapped: what `StemHostTables` holds in memory,
    read from the page cache instead. `gather(ids)` copies only the rows asked for. The map is advised random access
    (no read-ahead into tokens nobody asked for) and, with `will_need`, each gather first asks the kernel to read the
    rows' byte ranges in (`POSIX_FADV_WILLNEED`): one request per run of consecutive ids, issued together, instead of
    one page fault at a time. Refuses a file that is truncated or does not match `config` (layers, vocabulary, width,
    dtype) or the save the model was loaded from (`save_id`). Checked against a model (`config` or `save_id` given),
    a store and model whose save ids cannot be compared (either has none, or the model's tables changed since its last
    load or save) are refused too, unless `allow_unverified=True`: shapes alone do not tell two models' tables apart.
    `table_dtype`: the dtype the model's tables are held in, if not `config.table_dtype` (trained tables: float32)."""

    int8, scales = False, None

    def __init__(
        self,
        path: str | os.PathLike,
        config=None,
        save_id: str | None = None,
        will_need: bool = True,
        allow_unverified: bool = False,
        table_dtype: str | None = None,
    ):
        self.path = os.fspath(path)
        metadata = _read_store_metadata(self.path)
        self.layers = json.loads(metadata["stem_layers"])
        self.data = map_safetensors(self.path).get(STORE_TENSOR)
        if self.data is None or self.data.dim() != 3 or self.data.shape[1] != len(self.layers):
            raise ValueError(f"{self.path}: no [vocab, {len(self.layers)}, d_ff] tensor {STORE_TENSOR!r} in the store")
        self.vocab_size, _, self.width = self.data.shape
        self.table_dtype = self.data.dtype
        if config is not None:
            expected = {
                "stem_layers": (config.stem_layers, self.layers),
                "vocab_size": (config.vocab_size, self.vocab_size),
                "intermediate_size": (config.intermediate_size, self.width),
                "table_dtype": (table_dtype or config.table_dtype, str(self.table_dtype).removeprefix("torch.")),
            }
            for name, (want, have) in expected.items():
                if want != have:
                    raise ValueError(
                        f"{self.path}: the store has {name} {have} but the model's config says {want}; it was written "
                        "from another checkpoint: write it again with `stem-hf offload-store CHECKPOINT`"
                    )
        if config is not None or save_id is not None:
            _check_store_save(self.path, metadata.get(SAVE_ID_KEY), save_id, allow_unverified)
        self.slot = {layer: i for i, layer in enumerate(self.layers)}
        self.offset = _tensor_offset(self.path, STORE_TENSOR)  # where row 0 begins in the file
        self.will_need = will_need and hasattr(os, "posix_fadvise")
        self._fd = os.open(self.path, os.O_RDONLY) if self.will_need else None
        advise_random_access(self.data)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def row_bytes(self) -> int:
        return self.nbytes // self.vocab_size

    def advise(self, ids: torch.Tensor) -> None:
        """Asks the kernel to start reading the rows of `ids` in, one request per run of consecutive ids."""
        if not self.will_need or ids.numel() == 0:
            return
        ids = torch.unique(ids.reshape(-1).cpu())
        breaks = (ids[1:] != ids[:-1] + 1).nonzero().squeeze(1) + 1  # where a new run of consecutive ids starts
        first = ids[torch.cat([breaks.new_zeros(1), breaks])]
        ends = ids[torch.cat([breaks, breaks.new_full((1,), len(ids))]) - 1] + 1
        row = self.row_bytes()
        for begin, end in zip(first.tolist(), ends.tolist(), strict=True):
            os.posix_fadvise(self._fd, self.offset + begin * row, (end - begin) * row, os.POSIX_FADV_WILLNEED)

    def gather(self, ids: torch.Tensor, out: torch.Tensor | None = None, out_scales: torch.Tensor | None = None):
        self.advise(ids)
        return gather_rows(self.data, ids, out=out), None

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)


class StemRowCache:
    """Device-resident rows of up to `capacity` tokens, evicting the least frequently used (least recently used among
    equals). Use counts never decay: this suits a vocabulary whose frequent tokens stay frequent (text); a workload
    whose hot set moves would want aging. Bookkeeping lives on the host, in tensors: `slot_of[token]` (-1: absent),
    and per slot its token, use count and last use."""

    def __init__(
        self, capacity: int, vocab_size: int, layers: int, width: int, dtype: torch.dtype, device, scales: bool
    ):
        self.capacity = capacity
        self.rows = torch.empty((capacity, layers, width), dtype=dtype, device=device)
        self.scales = torch.empty((capacity, layers), dtype=torch.float32, device=device) if scales else None
        self.token = torch.full((capacity,), -1, dtype=torch.long)
        self.uses = torch.zeros(capacity, dtype=torch.long)
        self.last = torch.zeros(capacity, dtype=torch.long)
        self.slot_of = torch.full((vocab_size,), -1, dtype=torch.long)
        self.clock = 0
        self.hits = self.misses = 0

    def cached(self) -> set[int]:
        return set(self.token[self.token >= 0].tolist())

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each id (-1 on a miss); counts hits and misses and marks hits used now."""
        self.clock += 1
        slots = self.slot_of[ids]
        hit = slots >= 0
        self.hits += int(hit.sum())
        self.misses += int((~hit).sum())
        self.uses[slots[hit]] += 1
        self.last[slots[hit]] = self.clock
        return slots

    def drop(self, ids: torch.Tensor) -> None:
        """Forgets the rows of `ids` (their store rows changed): their slots become empty, the first to be reused."""
        slots = self.slot_of[ids]
        slots = slots[slots >= 0]
        self.token[slots], self.uses[slots], self.last[slots] = -1, 0, 0
        self.slot_of[ids] = -1

    def insert(self, ids: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor | None, keep: torch.Tensor) -> None:
        """Caches `rows` of `ids` (device tensors), evicting by (uses, last use) but never the slots in `keep`."""
        if self.capacity == 0 or len(ids) == 0:
            return
        empty = self.token < 0
        order = torch.argsort(self.uses * (self.clock + 1) + self.last + empty.long() * -(2**62))
        order = order[~torch.isin(order, keep)][: len(ids)]
        ids, rows = ids[: len(order)], rows[: len(order)]
        evicted = self.token[order]
        self.slot_of[evicted[evicted >= 0]] = -1
        self.slot_of[ids] = order
        self.token[order], self.uses[order], self.last[order] = ids, 1, self.clock
        device_order = order.to(self.rows.device)
        self.rows[device_order] = rows
        if self.scales is not None:
            self.scales[device_order] = scales[: len(order)]


class StemOffloadedRows:
    """What the STEM layers index: the unique rows of one forward for every layer, on the compute device. `lookup`
    hands a layer the unique rows and each position's place among them, for it to gather inside its own kernel where
    the model's config fuses lookups (`lookup_fuses`), as the model's own rows from host memory are."""

    def __init__(self, engine: "StemOffloadEngine", rows, scales, inverse: torch.Tensor, ready):
        self.engine, self.rows, self.scales, self.inverse, self.ready = engine, rows, scales, inverse, ready
        self.fusing = lookup_fuses(engine.model.config, inverse)  # once per forward: config reads are slow

    def distinct(self, layer_idx: int) -> torch.Tensor:
        """STEM layer `layer_idx`'s rows of the forward's distinct ids (dequantized, for an int8 store)."""
        if self.ready is not None:  # the copy runs on a side stream: wait for it once, on first use
            torch.cuda.current_stream(self.engine.device).wait_event(self.ready)
            self.ready = None
        slot = self.engine.store.slot[layer_idx]
        return self.engine._dequantized(self.rows[:, slot], None if self.scales is None else self.scales[:, slot])

    def __getitem__(self, layer_idx: int) -> torch.Tensor:
        return self.distinct(layer_idx)[self.inverse]

    def lookup(self, layer_idx: int) -> torch.Tensor | StemLookup:
        if not self.fusing:
            return self[layer_idx]
        return StemLookup(self.distinct(layer_idx), self.inverse)


class StemPipelinedRows(StemOffloadedRows):
    """One forward's rows fetched layer by layer on the engine's worker thread, `HOST_ROWS_AHEAD` STEM layers ahead of
    the layer that reads them: each layer's gather and copy overlap the layers before it, as the model's own host
    tables' rows do (`StemTableRows`), where one gather of every layer's rows would come before the first layer."""

    def __init__(self, engine: "StemOffloadEngine", unique: torch.Tensor, inverse: torch.Tensor):
        super().__init__(engine, None, None, inverse, None)
        self.unique, self._ahead, self._served = unique, {}, set()
        self.main = torch.cuda.current_stream(engine.device) if engine.cuda else None  # the stream that reads them

    def distinct(self, layer_idx: int) -> torch.Tensor:
        if layer_idx in self._served:  # asked again: fetched again, nothing ahead
            rows, scales, ready = self.engine._fetch_layer(layer_idx, self.unique, self.main)
        else:
            self._fetch_ahead(layer_idx)
            rows, scales, ready = self._ahead.pop(layer_idx).result()
            self._served.add(layer_idx)
        if ready is not None:
            torch.cuda.current_stream(self.engine.device).wait_event(ready)
        return self.engine._dequantized(rows, scales)

    def start(self) -> None:
        """Starts the first STEM layer's fetch and the `HOST_ROWS_AHEAD` after it, before the layers run."""
        self._fetch_ahead(min(self.engine.store.layers))

    def _fetch_ahead(self, layer_idx: int) -> None:
        """Starts the fetches of `layer_idx` and the `HOST_ROWS_AHEAD` STEM layers after it not yet started."""
        for layer in layers_ahead(self.engine.store.layers, layer_idx, (self._ahead, self._served)):
            self._ahead[layer] = self.engine._pool().submit(self.engine._fetch_layer, layer, self.unique, self.main)


class StemOffloadEngine:
    """Serves a STEM model's table rows from host memory. Use as a context manager or `attach()`/`detach()`:

        with StemOffloadEngine(model, cache_tokens=4096):
            model.generate(input_ids, max_new_tokens=64)

    `device`: where rows go (default: the device of the model's embedding). `cache_tokens`: rows of that many tokens
    kept on the device (0: none). `int8`: store tables as int8 with per-row scales. `dtype`: the store dtype
    (default: the tables'). `free_tables`: once the store is built, drop the model's own tables (host memory is then
    the store's only). `store`: the path of a mapped store (`write_offload_store`) to gather from instead of building
    one in memory: for tables larger than memory (checked against the model's config and save; `allow_unverified`
    accepts a store whose save cannot be compared with the model's, see `StemMappedTables`). `pipeline_ids`: without
    a row cache, a forward with at least this many distinct ids fetches its rows layer by layer on a worker thread,
    ahead of the layers (`StemPipelinedRows`), and a smaller one in one gather for every layer (default:
    `PIPELINE_MIN_IDS` on CUDA, where the copies overlap the layers, for a store in memory; by default never on a CPU
    or from a mapped store, whose pages a layer-by-layer read would visit once per layer).

    Attached, the engine is the model's row source (`StemModel.row_source`), and `persist_edit` writes edits into the
    rows it serves through `read_rows`/`write_rows`/`kept_rows` (a store built in memory only: a mapped one refuses)."""

    def __init__(
        self,
        model: nn.Module,
        cache_tokens: int = 0,
        int8: bool = False,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        free_tables: bool = False,
        store: str | os.PathLike | None = None,
        allow_unverified: bool = False,
        pipeline_ids: int | None = None,
    ):
        if pipeline_ids is not None and (isinstance(pipeline_ids, bool) or not isinstance(pipeline_ids, int)):
            raise ValueError(f"pipeline_ids: {pipeline_ids!r} is not a whole number of distinct ids")
        if pipeline_ids is not None and (pipeline_ids < 1 or cache_tokens):
            problem = "is below 1" if pipeline_ids < 1 else "is an option of an engine without a row cache"
            raise ValueError(f"pipeline_ids: {pipeline_ids} {problem}")
        # The engine serves a copy of the tables' rows: it would not follow an adapter's (set_adapter,
        # disable_adapter, training), and freeing the tables would go through PEFT's wrapper.
        self.model, self.tables_module = model, unwrapped_tables(model, "StemOffloadEngine")
        base = model.base_model
        self.device = torch.device(device) if device is not None else base.embed_tokens.weight.device
        if store is not None:
            if int8 or dtype is not None or free_tables:
                raise ValueError(
                    "store: a mapped store serves the tables' own rows from its file; int8, dtype and free_tables "
                    "are options of a store built in memory"
                )
            save_id = getattr(model, "stem_save_id", None)
            held = held_table_dtype(m.weight for m in self.tables_module.values())
            self.store = StemMappedTables(
                store, model.config, save_id, allow_unverified=allow_unverified, table_dtype=held
            )
        else:
            if allow_unverified:
                raise ValueError("allow_unverified: only a mapped store (store=PATH) is checked against a save")
            tables = {int(k): m.weight for k, m in self.tables_module.items()}
            self.store = StemHostTables(tables, dtype=dtype, int8=int8)
        self.cuda = self.device.type == "cuda"
        if pipeline_ids is None and self.cuda and not cache_tokens and store is None:
            pipeline_ids = PIPELINE_MIN_IDS  # a mapped store's pages would be read a layer at a time: not by default
        self.pipeline_ids = pipeline_ids
        n, width = len(self.store.layers), self.store.width
        dtype, vocab = self.store.data.dtype, self.store.vocab_size
        self.cache = StemRowCache(cache_tokens, vocab, n, width, dtype, self.device, int8) if cache_tokens else None
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._staging, self._turn, self._events = [None, None], 0, [None, None]
        self.fetched_tokens = self.forwards = self.planned_forwards = 0
        self._plan: deque[torch.Tensor] = deque()
        self._ahead: Future | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._attached = False
        self.freed = free_tables
        if free_tables:
            for module in self.tables_module.values():
                module.weight = nn.Parameter(torch.empty(0, width, dtype=module.weight.dtype), requires_grad=False)

    def attach(self) -> "StemOffloadEngine":
        """Serves the model's rows from the engine (`StemModel.set_row_source`) until `detach`. The engine reads its own
        store, so it must be the first source: a `StemEditor` entered afterwards edits the ids the engine serves."""
        if not self._attached:
            base = self.model.base_model
            if base.row_source is not None:
                raise RuntimeError(
                    f"attach: the model's rows already come from {base.row_source!r}, which the engine would bypass; "
                    "attach the engine first, then enter editors"
                )
            base.set_row_source(self)
            self._attached = True
        return self

    def detach(self) -> None:
        """Gives the model its own tables back as row source. Tables freed by `free_tables=True` are rebuilt from the
        store first (exactly: an int8 store cannot rebuild them, and refuses), so the model runs and saves as before."""
        base = self.model.base_model
        if self._attached and base.row_source is not self:
            raise RuntimeError(
                f"detach: {base.row_source!r}, set after this engine, still serves the model's rows; leave it first"
            )
        self._drop_plan()
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        if self.freed:
            if self.store.int8:
                raise ValueError("detach: the tables were freed and the store is int8: they cannot be rebuilt exactly")
            for layer, slot in self.store.slot.items():
                rows = self.store.data[:, slot].clone()
                self.tables_module[str(layer)].weight = nn.Parameter(rows, requires_grad=False)
            self.freed = False
        if self._attached:
            base.set_row_source(None)
            self._attached = False

    def __enter__(self) -> "StemOffloadEngine":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def __call__(self, stem_input_ids: torch.Tensor) -> "StemOffloadedRows":
        """The model's row source while attached (`StemRowSource`): `rows`."""
        return self.rows(stem_input_ids)

    def check_writable(self) -> None:
        """Raises unless `write_rows` can change what the engine serves: a mapped store's file is never written."""
        if isinstance(self.store, StemMappedTables):
            raise ValueError(
                f"StemOffloadEngine serves the memory-mapped offload store {self.store.path}, which is never altered, "
                "so a persisted edit would not reach what it serves: detach the engine (engine.detach()) before "
                "editing the tables; then save the model and write its store again with `stem-hf offload-store "
                "CHECKPOINT`"
            )

    def read_rows(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """STEM layer `layer`'s rows of `ids` as the engine serves them, on the host in float32."""
        return self.store.read(layer, self._host_ids(ids, "read_rows: ids"))

    @torch.no_grad()
    def write_rows(self, layer: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Replaces STEM layer `layer`'s rows of `ids` in the store the engine serves (cast or quantized as the store
        was built), so later forwards serve them: those ids leave the row cache, and a planned gather is dropped."""
        self.check_writable()
        ids = self._host_ids(ids, "write_rows: ids")
        self._settle_reads()
        self.store.write(layer, ids, rows)
        if self.cache is not None:
            self.cache.drop(ids)

    @contextmanager
    def kept_rows(self, ids: torch.Tensor) -> Iterator[None]:
        """Puts the rows of `ids` (every layer, and their int8 scales) back exactly as they were on leaving the block:
        `editing.persisted` undoes its edit with it."""
        self.check_writable()
        ids = self._host_ids(ids, "kept_rows: ids")
        rows, scales = self.store.gather(ids)  # copies
        try:
            yield
        finally:
            self._settle_reads()
            self.store.restore(ids, rows, scales)
            if self.cache is not None:
                self.cache.drop(ids)

    def _host_ids(self, ids, name: str) -> torch.Tensor:
        """`ids` as host int64, after checking they are integer token ids of the store's vocabulary."""
        ids = torch.as_tensor(ids)
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"{name} has dtype {ids.dtype}: token ids must be integers (pass ids.long())")
        check_token_ids(ids, self.store.vocab_size, name)
        return ids.reshape(-1).to("cpu", torch.long)

    @property
    def stats(self) -> dict:
        return {
            "forwards": self.forwards,
            "fetched_tokens": self.fetched_tokens,
            "fetched_bytes": self.fetched_tokens * self.store.row_bytes(),
            "cache_hit_rate": self.cache.hit_rate if self.cache else None,
            "planned_forwards": self.planned_forwards,
            "host_bytes": self.store.nbytes,
            "mapped": isinstance(self.store, StemMappedTables),
        }

    def _stage(self, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A staging buffer for `n` tokens, alternating between two so that a gather never writes into rows whose
        copy to the device may still be running (or, on the CPU path, that the forward before may still read).
        Pinned when there is a CUDA device to copy to: page-locked memory is what lets that copy run asynchronously."""
        self._turn ^= 1
        if self._events[self._turn] is not None:
            self._events[self._turn].synchronize()
        buffer = self._staging[self._turn]
        if buffer is None or buffer[0].shape[0] < n:
            shape = (max(n, 256), len(self.store.layers), self.store.width)
            rows = torch.empty(shape, dtype=self.store.data.dtype, pin_memory=self.cuda)
            scales = torch.empty(shape[:2], dtype=torch.float32, pin_memory=self.cuda) if self.store.int8 else None
            buffer = self._staging[self._turn] = (rows, scales)
        rows, scales = buffer
        return rows[:n], None if scales is None else scales[:n]

    def _fetch(self, ids: torch.Tensor, main=None):
        """Rows (and scales) of host ids `ids` on the device, and the event that marks the copy done (CUDA only).
        `main`: the stream that will read them (default: the current one; a worker thread must pass the caller's)."""
        self.fetched_tokens += len(ids)
        out_rows, out_scales = self._stage(len(ids))
        rows, scales = self.store.gather(ids, out_rows, out_scales)
        if not self.cuda:  # on the CPU path the forward reads the staging buffer itself; no copy to wait for
            return rows.to(self.device), None if scales is None else scales.to(self.device), None
        main = main or torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            rows = rows.to(self.device, non_blocking=True)
            scales = None if scales is None else scales.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        for tensor in (rows, scales):  # made on the side stream, read on the main one: keep it until that is done
            if tensor is not None:
                tensor.record_stream(main)
        self._events[self._turn] = event
        return rows, scales, event

    @torch.no_grad()
    def prefetch(self, ids: torch.Tensor) -> int:
        """Brings the rows of `ids` (say, a whole prompt, known before any compute) into the cache, so that the
        forwards that follow (prefill chunks, then decode) find them there. Returns how many tokens were fetched."""
        if self.cache is None:
            raise ValueError("prefetch: the engine has no row cache (cache_tokens=0) to prefetch into")
        unique = torch.unique(self._host_ids(ids, "prefetch: ids"))[: self.cache.capacity]
        slots = self.cache.slot_of[unique]
        missing = slots < 0
        if not missing.any():
            return 0
        self._fetch_into_cache(unique[missing], keep=slots[~missing])
        return int(missing.sum())

    def plan(self, ids: torch.Tensor, chunk_size: int) -> None:
        """Announces the prefill that `generate(ids, prefill_chunk_size=chunk_size)` is about to run. Its chunks are
        known before any compute, so the first chunk's rows are gathered now, and while each chunk computes a
        background thread gathers the next one's into the other staging buffer (and, on a GPU, starts its copy on the
        side stream). A forward that is not the next planned chunk drops the plan and is served as usual. Without a
        row cache only: with one, `prefetch(ids)` brings the whole prompt's rows in up front instead."""
        if self.cache is not None:
            raise ValueError("plan: the engine has a row cache; prefetch(ids) brings the whole prompt into it instead")
        if chunk_size < 1:
            raise ValueError(f"plan: chunk_size {chunk_size} must be at least 1")
        if ids.numel() == 0:
            raise ValueError("plan: the prompt is empty")
        self._host_ids(ids, "plan: ids")  # here, not as a failed gather on the worker thread
        self._drop_plan()
        ids = ids.detach().cpu().long()  # as the forwards' ids are, which each chunk is compared with
        self._plan = deque(ids[:, start : start + chunk_size] for start in range(0, ids.shape[1], chunk_size))
        self._gather_ahead()

    def _settle_reads(self) -> None:
        """Before the store is written: the plan dropped (its stale rows forgotten) and every read the worker thread
        has queued ended (a pipelined forward that raised may leave fetches of layers it never reached)."""
        self._drop_plan()
        if self._worker is not None:
            self._worker.submit(int).result()  # one thread, in order: runs after everything queued before it

    def _pool(self) -> ThreadPoolExecutor:
        """The worker thread that gathers ahead (planned chunks, pipelined layers), started on first use."""
        self._worker = self._worker or ThreadPoolExecutor(1, thread_name_prefix="stem-rows")
        return self._worker

    def _gather_ahead(self) -> None:
        """Starts gathering the next planned chunk's rows on the worker thread."""
        main = torch.cuda.current_stream(self.device) if self.cuda else None  # this thread's stream reads them
        self._ahead = self._pool().submit(self._gather, self._plan[0], main) if self._plan else None

    def _dequantized(self, rows: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        """One layer's distinct rows as the layers read them: int8 rows (with their `[n]` scales) dequantized to the
        tables' dtype, the unique rows only; others as they are."""
        if scales is None:
            return rows
        dtype = self.store.table_dtype
        return rows.to(dtype) * scales[:, None].to(dtype)

    def _fetch_layer(
        self, layer: int, unique: torch.Tensor, main: "torch.cuda.Stream | None"
    ) -> tuple[torch.Tensor, torch.Tensor | None, "torch.cuda.Event | None"]:
        """STEM layer `layer`'s rows (and int8 scales) of host ids `unique` on the device, and the event that marks
        their copies done (CUDA only; both copies run on one side stream, so the later event covers both)."""
        slot = self.store.slot[layer]
        rows, ready = fetch_rows(self.store.data[:, slot], unique, self.device, main)
        if self.store.scales is None:
            return rows, None, ready
        scales, ready = fetch_rows(self.store.scales[:, slot], unique, self.device, main)
        return rows, scales, ready

    def _gather(self, ids: torch.Tensor, main):
        """Unique rows of `ids` fetched in one gather (what `rows` does for a forward without a cache that it does not
        pipeline), and where each position's row is."""
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        rows, scales, ready = self._fetch(unique, main)
        return rows, scales, ready, inverse.view(ids.shape)

    def _drop_plan(self) -> None:
        """Forgets the plan, once the gather under way (which uses the staging buffers) has ended. A failed gather is
        forgotten too: the forward that needs those rows fetches them itself."""
        ahead, self._plan, self._ahead = self._ahead, deque(), None
        if ahead is not None and ahead.exception() is not None:  # exception() waits for the gather to end
            message = f"plan: a background gather failed ({ahead.exception()!r}); forwards fetch their own rows"
            warnings.warn(message, stacklevel=2)

    def _fetch_into_cache(self, ids: torch.Tensor, keep: torch.Tensor):
        """Fetches the rows of `ids` (cache misses), caches them without evicting the slots in `keep`, and returns
        them, copied and ready on the device."""
        rows, scales, ready = self._fetch(ids)
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        self.cache.insert(ids, rows, scales, keep=keep)
        return rows, scales

    @torch.no_grad()
    def rows(self, stem_input_ids: torch.Tensor) -> StemOffloadedRows:
        """The rows of one forward for every STEM layer: the engine's row source (`StemRowSource`)."""
        self.forwards += 1
        if self._plan:
            host_ids = stem_input_ids.cpu()
            if torch.equal(host_ids, self._plan[0]) and self._ahead.exception() is None:
                rows, scales, ready, inverse = self._ahead.result()
                self._plan.popleft()
                self._gather_ahead()
                self.planned_forwards += 1
                return StemOffloadedRows(self, rows, scales, inverse.to(self.device, non_blocking=True), ready)
            self._drop_plan()
        unique, inverse = torch.unique(stem_input_ids.reshape(-1).cpu(), return_inverse=True)
        inverse = inverse.view(stem_input_ids.shape).to(self.device, non_blocking=True)
        if self.cache is None:  # what a planned forward got from the worker, fetched here and now
            if self.pipeline_ids is not None and len(unique) >= self.pipeline_ids:
                self.fetched_tokens += len(unique)
                if isinstance(self.store, StemMappedTables):
                    self.store.advise(unique)  # every layer's rows of a token are one range: asked for at once
                rows = StemPipelinedRows(self, unique, inverse)
                rows.start()  # as the forward starts: the embedding and the layers before the first STEM one overlap
                return rows
            rows, scales, ready = self._fetch(unique)
            return StemOffloadedRows(self, rows, scales, inverse, ready)
        slots = self.cache.lookup(unique)
        miss = slots < 0
        rows = torch.empty((len(unique), *self.store.data.shape[1:]), dtype=self.store.data.dtype, device=self.device)
        scales = torch.empty(rows.shape[:2], dtype=torch.float32, device=self.device) if self.store.int8 else None
        hit_positions = (~miss).nonzero().squeeze(1).to(self.device)
        rows[hit_positions] = self.cache.rows[slots[~miss].to(self.device)]
        if scales is not None:
            scales[hit_positions] = self.cache.scales[slots[~miss].to(self.device)]
        if miss.any():
            fetched, fetched_scales = self._fetch_into_cache(unique[miss], keep=slots[~miss])
            miss_positions = miss.nonzero().squeeze(1).to(self.device)
            rows[miss_positions] = fetched
            if scales is not None:
                scales[miss_positions] = fetched_scales
        return StemOffloadedRows(self, rows, scales, inverse, None)


@contextmanager
def offloaded(model: nn.Module, **kwargs) -> Iterator[StemOffloadEngine]:
    """`with offloaded(model, cache_tokens=4096) as engine: model.generate(...)`."""
    engine = StemOffloadEngine(model, **kwargs)
    with engine:
        yield engine


__all__ = [
    "PIPELINE_MIN_IDS",
    "STORE_NAME",
    "StemHostTables",
    "StemMappedTables",
    "StemOffloadEngine",
    "StemOffloadedRows",
    "StemPipelinedRows",
    "StemRowCache",
    "offloaded",
    "write_offload_store",
]
