"""Training STEM models with the engines people already use (Trainer, accelerate).

- `param_groups`: weight decay for dense matrices only; norms, biases and tables undecayed; tables get their own
  learning rate (a table row sees a gradient only when its token is in the batch, so it needs a larger one).
- `RowSparseAdamW`: AdamW whose table groups keep moments only for rows that have had a gradient and update only the
  rows in the batch (lazy Adam, as `torch.optim.SparseAdam`), with dense tables gradients, so Trainer's clipping and
  accelerate work unchanged. Optimizer state for the tables then scales with the rows seen, not the vocabulary.
- `build_optimizer` / `StemTrainer`: both plugged into `Trainer`.
- `recipe="paper"` (`StemTrainer`, `build_optimizer`, with `PAPER_ARGUMENTS`): the reference code's optimizer instead.
"""

import contextlib
import copy
import os
import re
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from operator import itemgetter

import torch
from accelerate.utils import DynamoBackend
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.utils import logging

from .checkpoint_stem import TABLE_KEY
from .extras import require
from .modeling_stem import StemTable, StemTables, fuses_lookups_on, gather_rows

logger = logging.get_logger(__name__)

# The authors' reference optimizer (Infini-AI-Lab/STEM, a Meta Lingua fork: `lingua/optim.py`, the 350M configs, the
# training script's joint clip): AdamW over every parameter in one group, so tables, norms and embeddings decay alike;
# dense gradients; one clip over all gradients; linear warmup, then cosine to a tenth of the peak rate. These are the
# `TrainingArguments` fields `recipe="paper"` needs; the rate, warmup and steps are the user's.
PAPER_ARGUMENTS = {
    "weight_decay": 0.1,
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "adam_epsilon": 1e-8,
    "max_grad_norm": 1.0,
    "lr_scheduler_type": "cosine_with_min_lr",
    "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
}
RECIPES = ("stem-hf", "paper")
# What PEFT trains of a table under its own names, per adapter: the rows of trainable tokens (`lora_config(token_ids=
# ...)`), or a whole copy (`modules_to_save`).
PEFT_TABLE_KEY = re.compile(
    r"(?:^|\.)stem_tables\.\d+\.(?:token_adapter\.trainable_tokens_delta\.[^.]+|modules_to_save\.[^.]+\.weight)$"
)
_PAPER_ARGUMENTS = copy.deepcopy(PAPER_ARGUMENTS)  # what the check compares with: `TrainingArguments` keeps the dict
STATE_DTYPE = torch.float32  # moments and the update math, whatever the parameter dtype
# Elements of a host table's rows updated per pass: a chunk's temporaries reuse a few megabytes, where whole-batch
# temporaries would be fresh, page-faulted memory at every step.
ROW_CHUNK_ELEMENTS = 1 << 20
# Float32 host tables: each row takes torch's fused CPU AdamW kernel in place, one tensor per row (its own step count),
# so the rows, moments and gradient are read and written once, with no gather, scatter or temporaries.
FUSED_HOST_ROWS = hasattr(torch, "_fused_adamw_")
# Rows a row worker takes at least: with fewer, handing them to other threads costs more than splitting saves.
ROWS_PER_WORKER = 64
# Tables on an accelerator: when the host reads how many rows have moments (a sync), the moments grow to hold at least
# this many more steps' rows, so that the next read is that many steps away.
ROW_HEADROOM_STEPS = 4
# Float32 bytes of dense parameters updated by one set of foreach operations: each operation is one kernel for many
# parameters, and the fp32 copies and temporaries it makes scale with this much, not with the whole group.
DENSE_STEP_BYTES = 1 << 28
# Dense parameters of at least this many elements take the compiled update (`compiled_dense`); smaller ones (norms,
# biases) the foreach pass, whose fixed dozen kernels serve them all, where a compiled call per parameter would cost the
# host more than the device saves.
COMPILED_DENSE_MIN_ELEMENTS = 1 << 16
_TABLE_WRITER: ThreadPoolExecutor | None = None
_ROW_WORKERS: tuple[ThreadPoolExecutor, int] | None = None
_ROW_WORKERS_LOCK = threading.Lock()


def _table_writer() -> ThreadPoolExecutor:
    """The one thread that writes host tables behind (`RowSparseAdamW(write_behind=True)`), in submission order."""
    global _TABLE_WRITER
    if _TABLE_WRITER is None:
        _TABLE_WRITER = ThreadPoolExecutor(1, thread_name_prefix="stem-table-writer")
    return _TABLE_WRITER


class TableWrite(Future):
    """A table update queued on the writer thread, left on the table as `weight.stem_pending_write` for readers to wait
    on (`modeling_stem.settle`) until it is done; a failed one stays, so that every read raises its error, until the
    optimizer's `settle()`. A copy of the table taken meanwhile carries none."""

    def __deepcopy__(self, memo) -> None:
        return None

    def __reduce__(self):
        return type(None), ()


def _write(write: TableWrite, param: torch.Tensor, update: Callable[..., None], *args) -> None:
    try:
        update(param, *args)
    except BaseException as error:
        write.set_exception(error)
        return
    # Before the result: the optimizer sets a new marker only after this write's result, so none is removed here.
    _unmark(param, write)
    write.set_result(None)


def _unmark(param: torch.Tensor, write: TableWrite) -> None:
    """Removes `write`'s marker from `param`, unless a later write has put its own there."""
    if param.__dict__.get("stem_pending_write") is write:
        del param.stem_pending_write


def _row_workers() -> tuple[ThreadPoolExecutor, int] | None:
    """Threads that each run the fused row kernel serially (one intra-op thread each) on a share of a step's rows, and
    how many; None where the calling thread runs one intra-op thread. The kernel's own parallel loop starts an OpenMP
    region for every row tensor, which costs more than the row's update once other threads have OpenMP teams too."""
    global _ROW_WORKERS
    if torch.get_num_threads() == 1:
        return None
    with _ROW_WORKERS_LOCK:
        if _ROW_WORKERS is None:
            count = torch.get_num_threads()
            started, default = threading.Barrier(count + 1, timeout=60), []

            def serial() -> None:
                default.append(torch.get_num_threads())  # a new thread's count: torch's process-wide one, as of now
                torch.set_num_threads(1)
                started.wait()

            workers = ThreadPoolExecutor(count, thread_name_prefix="stem-row-update", initializer=serial)
            try:
                for _ in range(count):  # each submit starts a thread: none is idle yet, all wait in `serial`
                    workers.submit(lambda: None)
                started.wait()
            except BaseException:
                started.abort()
                workers.shutdown(wait=False)
                raise
            finally:
                if default:  # the workers' `set_num_threads` also set the count new threads start with: put it back,
                    # from a thread of its own, since the call sets its caller's count too
                    restore = threading.Thread(target=torch.set_num_threads, args=(default[0],))
                    restore.start()
                    restore.join()
            _ROW_WORKERS = workers, count
        return _ROW_WORKERS


def _forget_table_writer() -> None:
    global _TABLE_WRITER, _ROW_WORKERS, _ROW_WORKERS_LOCK
    _TABLE_WRITER = None  # a forked child has the parent's executors but not their threads
    _ROW_WORKERS = None
    _ROW_WORKERS_LOCK = threading.Lock()  # another thread may have held it at the fork


def _drain_table_writer() -> None:
    """Before a fork (a DataLoader's workers at each epoch): no write is mid-way, and none is left for the child.
    Registered after concurrent.futures' own fork hook (imported above), so it runs before that one takes the lock
    `submit` needs."""
    if _TABLE_WRITER is None or threading.current_thread().name.startswith("stem-table-writer"):
        return
    with contextlib.suppress(RuntimeError):  # the interpreter is shutting down: no writer runs any more
        _TABLE_WRITER.submit(lambda: None).result()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_drain_table_writer, after_in_child=_forget_table_writer)


def adamw_rows(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    steps: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    grad: torch.Tensor,
    settings: torch.Tensor,
    moved: torch.Tensor | None = None,
) -> None:
    """`RowSparseAdamW`'s lazy AdamW of `rows` (distinct: each is written once; gradients `grad`, moments and step
    counts at `slots`, distinct too, as float32), in place, as one function for `torch.compile` to fuse: the gathers,
    the update and the scatters, where eager launches about twenty kernels. `settings`: lr, beta1, beta2, eps and weight
    decay, a tensor so that a new learning rate is not a recompile. `moved` (bool per row; None: all): the rows that
    step; the others keep their weights, moments and counts, without a host sync to leave them out."""
    lr, beta1, beta2, eps, weight_decay = settings.unbind()
    old_weight, old_avg, old_avg_sq, old_steps = param[rows], exp_avg[slots], exp_avg_sq[slots], steps[slots]
    step = old_steps + 1
    grad = grad.to(STATE_DTYPE)
    weight = old_weight.to(STATE_DTYPE) * (1 - lr * weight_decay)
    exp_avg_rows = old_avg.lerp(grad, (1 - beta1).to(STATE_DTYPE))
    exp_avg_sq_rows = old_avg_sq * beta2 + grad * grad * (1 - beta2)
    bias1, bias2 = (1 - beta1**step)[:, None], (1 - beta2**step)[:, None]
    weight = (weight - lr * (exp_avg_rows / bias1) / ((exp_avg_sq_rows / bias2).sqrt() + eps)).to(param.dtype)
    exp_avg_rows, exp_avg_sq_rows = exp_avg_rows.to(exp_avg.dtype), exp_avg_sq_rows.to(exp_avg_sq.dtype)
    step = step.to(steps.dtype)
    if moved is not None:
        weight = torch.where(moved[:, None], weight, old_weight)
        exp_avg_rows = torch.where(moved[:, None], exp_avg_rows, old_avg)
        exp_avg_sq_rows = torch.where(moved[:, None], exp_avg_sq_rows, old_avg_sq)
        step = torch.where(moved, step, old_steps)
    param.index_put_((rows,), weight)
    exp_avg.index_put_((slots,), exp_avg_rows)
    exp_avg_sq.index_put_((slots,), exp_avg_sq_rows)
    steps.index_put_((slots,), step)


_COMPILED_ADAMW_ROWS: Callable[..., None] | None = None


def _compiled_adamw_rows() -> Callable[..., None]:
    global _COMPILED_ADAMW_ROWS
    if _COMPILED_ADAMW_ROWS is None:  # one compile for every table and row count (dynamic shapes)
        _COMPILED_ADAMW_ROWS = torch.compile(adamw_rows, dynamic=True, fullgraph=True)
    return _COMPILED_ADAMW_ROWS


def adamw_dense(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, settings: torch.Tensor
) -> None:
    """`RowSparseAdamW`'s AdamW update of one dense parameter (float32 moments and math), in place, the operations of
    its foreach pass in their order, as one function for `torch.compile` to fuse: each tensor read and written once,
    where the foreach pass makes float32 copies of a lower-precision parameter and its gradient and reads and writes
    the moments in a kernel per operation. `settings` (`dense_settings`): the scalars the foreach pass takes, a tensor
    on the parameter's device, as `adamw_rows` takes its own (a new learning rate is no recompile, and no host sync)."""
    decay, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt = settings.unbind()
    grad = grad.to(STATE_DTYPE)
    weight = param.to(STATE_DTYPE) * decay  # no decay: a factor of exactly 1
    exp_avg.lerp_(grad, one_minus_beta1)
    exp_avg_sq.mul_(beta2).add_(grad * grad * one_minus_beta2)
    denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps
    param.copy_(weight + step_size * (exp_avg / denom))


def dense_settings(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, count: float) -> list[float]:
    """`adamw_dense`'s scalars at step `count`, computed in double precision as the foreach pass computes them."""
    step_size, bias_correction2_sqrt = -lr / (1 - beta1**count), (1 - beta2**count) ** 0.5
    return [1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, eps, step_size, bias_correction2_sqrt]


_COMPILED_ADAMW_DENSE: Callable[..., None] | None = None


def _compiled_adamw_dense() -> Callable[..., None]:
    global _COMPILED_ADAMW_DENSE
    if _COMPILED_ADAMW_DENSE is None:  # one compile per rank, dtype and device (dynamic shapes)
        # Not fullgraph: past dynamo's recompile limit (a model of many ranks and dtypes) the rest run eager, not fail.
        _COMPILED_ADAMW_DENSE = torch.compile(adamw_dense, dynamic=True)
    return _COMPILED_ADAMW_DENSE


def param_groups(
    model: nn.Module,
    lr: float,
    weight_decay: float = 0.0,
    table_lr: float | None = None,
    table_weight_decay: float = 0.0,
    row_sparse_tables: bool = False,
) -> list[dict]:
    """Four optimizer groups over the trainable parameters: `decay` (matrices, the token embedding included, as
    Trainer does), `no_decay` (norms and biases), `tables` (`lr=table_lr or lr`, `weight_decay=table_weight_decay`,
    `row_sparse=row_sparse_tables`) and `peft_tables` (what PEFT trains of a table under its own names: the rows of
    trainable tokens, a `modules_to_save` copy; as the tables, with dense gradients). Empty groups are left out; each
    group has a `name`."""
    decay, no_decay, tables, peft_tables = [], [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if TABLE_KEY.search(name):
            tables.append(param)
        elif PEFT_TABLE_KEY.search(name):
            peft_tables.append(param)
        elif param.ndim < 2:
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [
        {"name": "decay", "params": decay, "lr": lr, "weight_decay": weight_decay, "row_sparse": False},
        {"name": "no_decay", "params": no_decay, "lr": lr, "weight_decay": 0.0, "row_sparse": False},
        {
            "name": "tables",
            "params": tables,
            "lr": lr if table_lr is None else table_lr,
            "weight_decay": table_weight_decay,
            "row_sparse": row_sparse_tables,
        },
        {
            "name": "peft_tables",
            "params": peft_tables,
            "lr": lr if table_lr is None else table_lr,
            "weight_decay": table_weight_decay,
            "row_sparse": False,
        },
    ]
    return [group for group in groups if group["params"]]


def compiles_rows_by_default(device: torch.device) -> bool:
    """`RowSparseAdamW(compiled_rows=None)` and `(compiled_dense=None)`: on a CUDA device that Triton supports
    (compute capability 7.0 and up), where Triton is installed, tables get `adamw_rows` compiled (measured faster than
    the eager pass: `benchmarks/results/bench_gpu_train_compile_h100.json`) and dense parameters `adamw_dense` (one
    pass over each tensor: `benchmarks/bench_dense_step.py`): the devices `modeling_stem.fuses_lookups_on` names."""
    return fuses_lookups_on(device)


def _compiles(setting: bool | None, device: torch.device) -> bool:
    """What `RowSparseAdamW`'s `compiled_rows` or `compiled_dense` says for `device`: None, the default there."""
    return compiles_rows_by_default(device) if setting is None else setting


def _device_settings(values: list[float], device: torch.device) -> torch.Tensor:
    """`values` as a float32 tensor on `device`, for a compiled update to take as an input (a new learning rate is no
    recompile): on CUDA copied from pinned memory, since a pageable copy would wait for the device (a host sync)."""
    settings = torch.tensor(values, dtype=STATE_DTYPE)
    if device.type == "cuda":
        settings = settings.pin_memory()
    return settings.to(device, non_blocking=True)


def _static(settings: torch.Tensor) -> torch.Tensor:
    """`settings` marked static for a compiled update: its length a constant, so that no parameter axis of that size is
    taken for it (dynamo gives equal sizes one symbol)."""
    torch._dynamo.mark_static(settings)
    return settings


def _in_host_memory(param: torch.Tensor) -> bool:
    """Whether a table's rows are updated by the host's code paths (the fused per-row kernel, chunks)."""
    return param.device.type == "cpu"


def _memory(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device


def _same_memory(held: tuple, tensor: torch.Tensor) -> bool:
    """Whether views cached as `held` (the tensor, its memory, its views) are still views of `tensor`."""
    return held[0] is tensor and held[1] == _memory(tensor)


class RowSparseAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with fp32 moments and fp32 update math for every parameter.

    In groups with `row_sparse=True` (2-D parameters: the tables), a row is updated only when its gradient is nonzero
    (its token was in the batch), and its moments and bias correction advance only then: lazy Adam, with a step count
    per row (torch's SparseAdam keeps one per parameter). Moments are kept for rows that have had a gradient (on an
    accelerator: that have been in a batch), in slots allocated on first use (capacity doubles as needed: up to 2x the
    rows seen; on an accelerator also room for `ROW_HEADROOM_STEPS` more steps' rows), plus one int64 slot index per
    table row. A row present in every step is updated exactly as by AdamW; weight decay applies to updated rows. Dense
    groups take torch's multi-tensor (foreach) AdamW update, a fixed number of kernels per `DENSE_STEP_BYTES` of
    parameters whatever their count. Float32 tables in host memory are updated row by row, in place, by torch's fused
    CPU AdamW kernel on worker threads (`FUSED_HOST_ROWS`); other host tables in chunks of `ROW_CHUNK_ELEMENTS`;
    tables on an accelerator by `adamw_rows` over the batch's rows, a row without gradient masked, without reading
    anything back to the host (but the count of rows with moments every few steps, while the moments can grow).

    `compiled_rows`: the rows of tables on an accelerator updated by `adamw_rows` under `torch.compile` (dynamic
    shapes: one graph for every table and row count above one, per device and dtype), which fuses the eager pass's
    kernels; tables in host memory keep the host's paths (the fused per-row kernel is faster there). The default,
    None, compiles them on CUDA devices where Triton is installed (`compiles_rows_by_default`); False keeps the eager
    pass everywhere. `compiled_dense` likewise for the dense groups: each parameter of at least
    `COMPILED_DENSE_MIN_ELEMENTS` updated by `adamw_dense` under `torch.compile` (dynamic shapes: a graph per rank and
    dtype, and a few more for axes of size 0 or 1), one pass over the parameter, its gradient and moments where the
    foreach update makes a pass per operation and float32 copies of lower-precision parameters.

    `write_behind=True`: the sparse-gradient rows of tables in host memory whose model waits for such writes (marked
    `stem_reads_wait` by `StemTables.train()`; others are written in step) are written by a worker thread, and `step`
    returns once they are queued, so the accelerator goes on (the dense step, the next batch's layers) while the host
    updates the tables. The model reads a table only after its write (`modeling_stem.settle`: the row fetch of that
    layer, a state dict, a cast, a copy), as does this optimizer (`step`, `state_dict`, `load_state_dict`, a copy or
    pickle, `settle`). Read `table.weight` yourself only after `settle()`.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        row_sparse: bool = False,
        write_behind: bool = False,
        compiled_rows: bool | None = None,
        compiled_dense: bool | None = None,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"RowSparseAdamW: bad lr {lr}, betas {betas}, eps {eps} or weight_decay {weight_decay}")
        for name, value in (("compiled_rows", compiled_rows), ("compiled_dense", compiled_dense)):
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"RowSparseAdamW: {name} is None (the default), True or False: {value!r}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "row_sparse": row_sparse}
        self.write_behind = write_behind
        self.compiled_rows = compiled_rows
        self.compiled_dense = compiled_dense
        self._writes: list[tuple[torch.Tensor, TableWrite]] = []
        self._row_views: dict[torch.Tensor, dict] = {}
        self._rows_bound: dict[torch.Tensor, int] = {}  # per table on an accelerator: rows with moments, at most
        super().__init__(params, defaults)
        for group in self.param_groups:
            if isinstance(group["lr"], torch.Tensor):  # it failed in the first step, in a foreach op
                raise ValueError(
                    "RowSparseAdamW: lr must be a number, not a tensor (a tensor lr is for torch's capturable "
                    "optimizers): pass float(lr)"
                )
            if group["row_sparse"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("RowSparseAdamW: row_sparse groups hold 2-D parameters only (tables, embeddings)")
            if any(p.is_complex() for p in group["params"]):  # the float32 update would drop the imaginary part
                raise ValueError("RowSparseAdamW: complex parameters are not supported: use torch.optim.AdamW")
            if any(type(p).__name__ == "DTensor" for p in group["params"]):
                raise ValueError(
                    "RowSparseAdamW does not take FSDP-sharded (DTensor) parameters: under FSDP use torch.optim.AdamW "
                    "over param_groups(...) (StemTrainer does)"
                )

    @torch.no_grad()
    def step(self, closure=None):
        self.settle()
        self._drop_stale_row_views()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for param in params:
                if param.grad.is_sparse and not group["row_sparse"]:
                    raise ValueError("RowSparseAdamW: a sparse gradient in a group without row_sparse=True")
                if type(param).__name__ == "DTensor":  # sharded after this optimizer was built
                    raise ValueError("RowSparseAdamW does not take FSDP-sharded (DTensor) parameters: use AdamW")
            if not group["row_sparse"]:
                self._dense_step(params, group)
                continue
            for param in params:
                self._row_step(param, group)
        return loss

    def settle(self) -> None:
        """Waits for every table write `step` left behind, then raises the first error among them, once: the tables'
        markers are gone after it."""
        writes = self._writes
        errors = [write.exception() for _, write in writes]  # waits for each, even after one failed
        self._writes = []
        for param, write in writes:
            _unmark(param, write)
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise error

    def __getstate__(self) -> dict:
        self.settle()  # a copy or pickle takes the written rows' state, never a half-written one
        return {**super().__getstate__(), "compiled_rows": self.compiled_rows, "compiled_dense": self.compiled_dense}

    def __setstate__(self, state: dict) -> None:
        # torch's Optimizer pickles and copies defaults, state and groups only: a copy writes in step, with no writes.
        super().__setstate__(state)
        self.__dict__.setdefault("write_behind", False)
        self.__dict__.setdefault("compiled_rows", None)
        self.__dict__.setdefault("compiled_dense", None)
        self._writes = []
        self._row_views = {}
        self._rows_bound = {}

    def state_dict(self) -> dict:
        self.settle()
        return super().state_dict()

    def _dense_step(self, params: list[torch.Tensor], group: dict) -> None:
        """torch's foreach AdamW update (`torch.optim.adam._multi_tensor_adam` without amsgrad, its operations in its
        order), on fp32 copies of lower-precision parameters: one kernel per operation for each batch of parameters of
        one device and dtype, `DENSE_STEP_BYTES` at most. Where `compiled_dense` says (on CUDA with Triton, by
        default), the same operations as one compiled function per parameter (`adamw_dense`)."""
        batches: list[list[torch.Tensor]] = []  # one device and dtype each, within DENSE_STEP_BYTES (or one parameter)
        current, filled = {}, {}  # per (device, dtype): its open batch, and the bytes in it
        for param in params:
            key, size = (param.device, param.dtype), 4 * param.numel()
            if key not in current or filled[key] + size > DENSE_STEP_BYTES:
                current[key], filled[key] = len(batches), 0
                batches.append([])
            batches[current[key]].append(param)
            filled[key] += size
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        for same in batches:
            states = [self.state[p] for p in same]
            for param, state in zip(same, states, strict=True):
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, dtype=STATE_DTYPE)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=STATE_DTYPE)
            steps = [state["step"] for state in states]  # host tensors (as made above): reading them syncs nothing
            torch._foreach_add_(steps, 1)
            counts = torch.stack(steps).tolist()
            device = same[0].device
            if _compiles(self.compiled_dense, device):
                update, settings, rest = _compiled_adamw_dense(), {}, []
                for param, state, count in zip(same, states, counts, strict=True):
                    if param.numel() < COMPILED_DENSE_MIN_ELEMENTS:
                        rest.append((param, state, count))
                        continue
                    if count not in settings:  # the group's parameters step together: one copy to the device
                        values = dense_settings(lr, beta1, beta2, eps, weight_decay, count)
                        settings[count] = _static(_device_settings(values, device))
                    # Detached: dynamo gives a parameter static shapes, a compile per shape; a plain tensor takes
                    # dynamic ones. It shares the parameter's memory, which the update writes.
                    inputs = param.detach(), param.grad.detach(), state["exp_avg"], state["exp_avg_sq"]
                    update(*inputs, settings[count])
                if not rest:
                    continue
                same, states, counts = (list(column) for column in zip(*rest, strict=True))
            weights = [p.to(STATE_DTYPE) for p in same]
            grads = [p.grad.to(STATE_DTYPE) for p in same]
            exp_avgs = [state["exp_avg"] for state in states]
            exp_avg_sqs = [state["exp_avg_sq"] for state in states]
            if weight_decay != 0:
                torch._foreach_mul_(weights, 1 - lr * weight_decay)
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
            step_size = [(lr / (1 - beta1**count)) * -1 for count in counts]
            bias_correction2_sqrt = [(1 - beta2**count) ** 0.5 for count in counts]
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(denom, bias_correction2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(weights, exp_avgs, denom, step_size)
            for param, weight in zip(same, weights, strict=True):
                if weight is not param:
                    param.copy_(weight)

    def _row_step(self, param: torch.Tensor, group: dict) -> None:
        hyper = {key: group[key] for key in ("lr", "betas", "eps", "weight_decay")}  # as of now: the scheduler moves lr
        sparse = param.grad.is_sparse
        if sparse:  # `sparse_table_grads`: the batch's rows only, never a [vocab, d_ff] tensor
            rows, values = sparse_rows(param.grad, param)  # survive a zero_grad: it swaps the sparse grad's tensors
            if self.write_behind and param.device.type == "cpu" and getattr(param, "stem_reads_wait", False):
                write = TableWrite()
                write.set_running_or_notify_cancel()  # queued is as good as running: it cannot be cancelled
                param.stem_pending_write = write  # what the model's reads of this table wait for
                self._writes.append((param, write))
                _table_writer().submit(_write, write, param, self._row_update, rows, values, hyper, sparse)
                return
        else:
            rows = rows_with_gradient(param.grad).nonzero().squeeze(1)
            values = param.grad.index_select(0, rows)
        self._row_update(param, rows, values, hyper, sparse)

    def _row_update(
        self, param: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, hyper: dict, sparse: bool = False
    ) -> None:
        """Lazy AdamW of the distinct `rows`, gradients `values`; also on the writer thread, where no_grad is off."""
        with torch.no_grad():
            on_host = _in_host_memory(param)
            if not on_host:
                self._device_rows(param, rows, values, hyper, sparse)
                return
            fused = FUSED_HOST_ROWS and param.dtype == values.dtype == STATE_DTYPE and param.is_contiguous()
            kept = None  # the moved rows' places in `values`, where some did not move
            if sparse:  # a row in the batch with no gradient moves no more than under dense gradients
                moved = rows_with_gradient(values)
                if not bool(moved.all()):
                    kept = moved.nonzero().squeeze(1)
                    rows = rows[kept]
                    if not fused:  # the fused path picks the moved rows' gradients without copying them
                        values, kept = values[kept], None
            if rows.numel() == 0:
                return
            state = self.state[param]
            if not state:
                state["slot"] = torch.full((param.shape[0],), -1, dtype=torch.long, device=param.device)
                state["rows_seen"] = torch.zeros((), dtype=torch.long)
                self._grow(state, param, 0)
            slots = state["slot"][rows]
            new = rows[slots < 0]
            if new.numel():
                seen = int(state["rows_seen"])
                self._grow(state, param, seen + new.numel())
                state["slot"][new] = torch.arange(seen, seen + new.numel(), device=param.device)
                state["rows_seen"] += new.numel()
                self._rows_bound.pop(param, None)  # the device path's bound holds no longer
                slots = state["slot"][rows]
            if fused:
                self._fused_rows(param, state, rows, slots, values, kept, hyper)
                return
            self._row_views.pop(param, None)  # a table no longer updated row by row: its views go
            chunk = max(1, ROW_CHUNK_ELEMENTS // max(1, param.shape[1]))
            # Each chunk reuses the same buffers: fresh ones are new memory, page-faulted in every chunk.
            shape = (min(chunk, len(rows)), param.shape[1])
            buffers = [torch.empty(shape, dtype=STATE_DTYPE, device=param.device) for _ in range(5)]
            for start in range(0, len(rows), chunk):
                part, at = rows[start : start + chunk], slots[start : start + chunk]
                moment, square, row, scratch, ratio = (b[: len(part)] for b in buffers)
                exp_avg = gather_rows(state["exp_avg"], at, out=moment)
                exp_avg_sq = gather_rows(state["exp_avg_sq"], at, out=square)
                steps = state["steps"].index_select(0, at).add_(1)
                if param.dtype == STATE_DTYPE:
                    weight = gather_rows(param, part, out=row)
                else:
                    weight = param.index_select(0, part).to(STATE_DTYPE)
                grad = values[start : start + chunk].to(STATE_DTYPE)
                self._update(weight, grad, exp_avg, exp_avg_sq, steps[:, None], hyper, scratch, ratio)
                param.index_copy_(0, part, weight.to(param.dtype))  # a chunk's rows, moments and counts together
                state["exp_avg"].index_copy_(0, at, exp_avg)
                state["exp_avg_sq"].index_copy_(0, at, exp_avg_sq)
                state["steps"].index_copy_(0, at, steps)

    def _device_rows(
        self, param: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, hyper: dict, sparse: bool
    ) -> None:
        """The lazy AdamW of a table on an accelerator without a host sync, by `adamw_rows` (compiled as
        `compiled_rows` says). Every row of the batch gets a slot, a row without gradient too: it keeps its weights,
        zero moments and count (`moved`), as a row never seen does. Only growing the moments needs the true count of
        rows with a slot; the host keeps an upper bound of it (`_rows_bound`: every row of every step counted as new)
        and reads the count (a sync) when the bound passes the capacity, then grows the moments to hold at least
        `ROW_HEADROOM_STEPS` more steps' rows: a sync every few steps at most, none once the capacity is the whole
        table."""
        self._row_views.pop(param, None)
        if rows.numel() == 0:
            return
        state = self.state[param]
        if not state:
            state["slot"] = torch.full((param.shape[0],), -1, dtype=torch.long, device=param.device)
            self._grow(state, param, 0)
        seen = state.get("rows_seen")
        if seen is None or seen.device != param.device:  # new, or kept by a host path (a host tensor)
            count = 0 if seen is None else int(seen)
            seen = state["rows_seen"] = torch.full((), count, dtype=torch.long, device=param.device)
        capacity = state["exp_avg"].shape[0]
        if capacity < param.shape[0]:  # a full capacity holds every row: no bound to keep
            bound = self._rows_bound.get(param)
            if bound is None or bound + len(rows) > capacity:
                bound = int(seen)  # the sync: the moments may have to grow, with room for a few more steps' rows
                self._grow(state, param, bound + ROW_HEADROOM_STEPS * len(rows))
            self._rows_bound[param] = bound + len(rows)
        slots = state["slot"][rows]
        new = slots < 0
        slots = torch.where(new, seen + new.cumsum(0) - 1, slots)
        state["slot"].index_put_((rows,), slots)
        seen.add_(new.sum())
        moved = torch.linalg.vector_norm(values, 0, dim=1) > 0 if sparse else None
        beta1, beta2 = hyper["betas"]
        settings = _device_settings([hyper["lr"], beta1, beta2, hyper["eps"], hyper["weight_decay"]], param.device)
        update = adamw_rows
        if _compiles(self.compiled_rows, param.device):
            update, settings = _compiled_adamw_rows(), _static(settings)
        # Inputs that are not views: dynamo fails on a view (a sparse gradient's values) whose base changes.
        inputs = rows.detach(), slots.detach(), values.detach()
        update(param, state["exp_avg"], state["exp_avg_sq"], state["steps"], *inputs, settings, moved)

    def _fused_rows(
        self,
        param: torch.Tensor,
        state: dict,
        rows: torch.Tensor,
        slots: torch.Tensor,
        values: torch.Tensor,
        kept: torch.Tensor | None,
        hyper: dict,
    ) -> None:
        """The lazy AdamW of `rows` by torch's fused CPU kernel, each row (of the table, both moments, the gradient) a
        tensor of its own with its own step count: one pass over the touched memory, in place."""
        state["steps"].index_add_(0, slots, torch.ones(len(slots), dtype=STATE_DTYPE, device=param.device))
        at, where = slots.tolist(), rows.tolist()
        grads = values.contiguous().unbind(0)
        if kept is not None:
            grads = [grads[i] for i in kept.tolist()]
        lists = (
            self._rows(param, "param", param, rows, where),
            list(grads),
            self._rows(param, "exp_avg", state["exp_avg"], slots, at),
            self._rows(param, "exp_avg_sq", state["exp_avg_sq"], slots, at),
        )
        counts = self._rows(param, "steps", state["steps"], slots, at)

        def update(start: int, stop: int) -> None:
            with torch.no_grad():  # per thread: a worker's would be on, and the views are of parameters
                self._fused_kernel(lists, counts, start, stop, hyper)

        workers = _row_workers() if len(at) >= 2 * ROWS_PER_WORKER else None
        if workers is None:
            update(0, len(at))
            return
        pool, count = workers
        parts = min(count, len(at) // ROWS_PER_WORKER)
        bounds = [len(at) * i // parts for i in range(parts + 1)]  # rows are sorted: a share is one stretch of table
        shares = []
        try:
            for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
                shares.append(pool.submit(update, start, stop))
        finally:
            errors = [share.exception() for share in shares]  # waits for every share, even after one failed
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise error

    @staticmethod
    def _fused_kernel(lists: tuple[list, ...], counts: list, start: int, stop: int, hyper: dict) -> None:
        beta1, beta2 = hyper["betas"]
        torch._fused_adamw_(
            *(rows_of[start:stop] for rows_of in lists),
            [],
            counts[start:stop],
            lr=hyper["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=hyper["weight_decay"],
            eps=hyper["eps"],
            amsgrad=False,
            maximize=False,
        )

    def _rows(
        self, param: torch.Tensor, key: str, tensor: torch.Tensor, index: torch.Tensor, indices: list[int]
    ) -> list[torch.Tensor]:
        """Rows `index` (as a list: `indices`) of `tensor` as tensors of their own. A row's view, made the first time
        the row is updated, is kept for the next steps while `tensor` is the same memory (the views of a replaced
        table or state go at the next step, or with `drop_row_views`): making them at every step would cost a Python
        object per row per step, and views of every row would grow with the vocabulary, not the rows seen."""
        cache = self._row_views.setdefault(param, {})
        held = cache.get(key)
        if held is None or not _same_memory(held, tensor):
            made = torch.zeros(tensor.shape[0], dtype=torch.bool, device=tensor.device)
            held = cache[key] = (tensor, _memory(tensor), [None] * tensor.shape[0], made)
        views, made = held[2], held[3]
        new = index[~made[index]]
        if new.numel():
            for i in new.tolist():
                views[i] = tensor[i]
            made[new] = True
        return list(itemgetter(*indices)(views)) if len(indices) > 1 else [views[i] for i in indices]

    def drop_row_views(self) -> None:
        """Drops the row views the fused host update keeps between steps (they hold the memory of the tables and
        state they view); the next step makes the ones it needs. `StemTrainer.train()` does so before it returns."""
        try:
            self.settle()
        finally:
            self._row_views = {}  # settle() raises only once every write is done

    def _drop_stale_row_views(self) -> None:
        """A table or state tensor replaced since the last step (a cast, a move, a grown or loaded state): its views
        go, and with them the old memory."""
        for param in list(self._row_views):
            cache = self._row_views[param]
            state = self.state.get(param, {})
            current = {"param": param, **{k: state.get(k) for k in ("exp_avg", "exp_avg_sq", "steps")}}
            for key in list(cache):
                if current[key] is None or not _same_memory(cache[key], current[key]):
                    del cache[key]
            if not cache:
                del self._row_views[param]

    @staticmethod
    def _grow(state: dict, param: torch.Tensor, needed: int) -> None:
        capacity = state["exp_avg"].shape[0] if "exp_avg" in state else 0
        if needed <= capacity and "exp_avg" in state:
            return
        new_capacity = min(param.shape[0], max(needed, 2 * capacity, 64))
        for key, width in (("exp_avg", param.shape[1]), ("exp_avg_sq", param.shape[1]), ("steps", None)):
            shape = (new_capacity, width) if width else (new_capacity,)
            grown = torch.zeros(shape, dtype=STATE_DTYPE, device=param.device)
            if key in state:
                grown[:capacity] = state[key]
            state[key] = grown

    @staticmethod
    def _update(
        weight: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        step: torch.Tensor,
        group: dict,
        scratch: torch.Tensor | None = None,
        ratio: torch.Tensor | None = None,
    ) -> None:
        """One AdamW update in place; `step` is a count (tensor) broadcast against the rows. `scratch` and `ratio`,
        buffers of the rows' shape, take the two temporaries (None: new tensors)."""
        beta1, beta2 = group["betas"]
        if group["weight_decay"] != 0:  # a pass over the rows that would multiply them by one (tables: no decay)
            weight.mul_(1 - group["lr"] * group["weight_decay"])
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias1, bias2 = 1 - beta1**step, 1 - beta2**step
        denom = torch.div(exp_avg_sq, bias2, out=scratch).sqrt_().add_(group["eps"])
        weight.addcdiv_(torch.div(exp_avg, bias1, out=ratio), denom, value=-group["lr"])

    def load_state_dict(self, state_dict: dict) -> None:
        self.settle()
        self._row_views = {}  # views of the state being replaced
        self._rows_bound = {}  # bounds of that state: the next step reads the loaded counts
        # torch casts floating-point state to each parameter's dtype (bf16 tables would get bf16 moments) and every
        # state tensor of a float parameter to that dtype (slot indices included): restore the saved dtypes after.
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, values in saved.items():
            param = params[index]
            self.state[param] = {
                k: v.to(param.device, copy=True) if k not in ("step", "rows_seen") else v.clone()
                for k, v in values.items()
            }

    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state per group name (groups without a name are numbered)."""
        self.settle()
        total = {}
        for i, group in enumerate(self.param_groups):
            name = group.get("name", str(i))
            total[name] = sum(
                v.numel() * v.element_size()
                for p in group["params"]
                for v in self.state.get(p, {}).values()
                if torch.is_tensor(v)
            )
        return total


def stem_tables(model: nn.Module) -> list[nn.Embedding]:
    """Every STEM table module of `model` whose weight `param_groups` puts in the tables group (named
    `...stem_tables.N.weight`), however the model is wrapped (DDP, a compiled module). A copy PEFT trains under
    another name (`modules_to_save`) is not one: it lands in a dense group, where a sparse gradient is refused."""
    return [m for n, m in model.named_modules() if isinstance(m, StemTable) and TABLE_KEY.search(f"{n}.weight")]


def copy_table_grads_behind(model: nn.Module, enable: bool = True) -> None:
    """Lets the sparse gradients of `model`'s tables in host memory cross from CUDA while the backward goes on
    (`modeling_stem.copies_grad_behind`), or stops it. Only where nothing but the model's own lookups gives a table a
    gradient in a backward: a loss term on a table's weight would be added to a gradient still crossing."""
    for table in stem_tables(model):
        if enable:
            table.weight.stem_grad_copies_behind = True
        else:
            table.weight.__dict__.pop("stem_grad_copies_behind", None)


def use_sparse_table_grads(model: nn.Module, enable: bool = True) -> None:
    """Makes every table's gradient sparse: the batch's rows only, instead of a dense `[vocab, d_ff]` tensor that
    backward fills and the optimizer reads however few rows the batch touched. Needs an optimizer and clipping that
    take sparse gradients: `RowSparseAdamW` row-sparse groups and `clip_grad_norm` (`StemTrainer` uses both)."""
    tables = stem_tables(model)
    if enable and any(t.weight.requires_grad and t.weight.dtype != torch.float32 for t in tables):
        raise ValueError(
            "sparse table gradients need float32 tables (torch cannot add sparse bf16/fp16 gradients on CPU, so "
            "accumulation fails): call model.set_table_dtype('float32') first, as training tables should be anyway"
        )
    for table in tables:
        table.sparse = enable


def rows_with_gradient(values: torch.Tensor) -> torch.Tensor:
    """Which rows of a 2-D gradient hold a value other than zero (NaN counts), as `values.ne(0).any(1)` says.
    A row's first value settles most rows: a gradient row rarely has a zero there, and a row without gradient always
    does. Only rows with a zero first value are read whole, not the gradient's every byte (a host step's own pass)."""
    if values.shape[1] == 0:
        return torch.zeros(values.shape[0], dtype=torch.bool, device=values.device)
    if values.device.type != "cpu":  # picking the unsure rows would be a host sync on an accelerator
        return torch.linalg.vector_norm(values, 0, dim=1) > 0
    moved = values[:, 0] != 0
    unsure = (~moved).nonzero().squeeze(1)
    if 2 * len(unsure) > len(moved):  # mostly rows without gradient (a dense table gradient): one pass, no copy
        return torch.linalg.vector_norm(values, 0, dim=1) > 0
    if unsure.numel():
        moved[unsure] = torch.linalg.vector_norm(values.index_select(0, unsure), 0, dim=1) > 0
    return moved


def sparse_rows(grad: torch.Tensor, param: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct rows of a sparse table gradient and their gradients, coalesced only where rows repeat. A STEM
    table's gradient from one backward comes with distinct, sorted rows, but autograd's accumulation drops the flag
    that says so: `param`'s `stem_grad_rows` (`modeling_stem.distinct_sparse_grad`), when they are the gradient's own
    indices, says it without reading them. Otherwise a host gradient's rows are checked, and others coalesced (on an
    accelerator, a sort and a host sync)."""
    if grad.is_coalesced():
        return grad.indices()[0], grad.values()
    rows = grad._indices()
    known = getattr(param, "stem_grad_rows", None)
    same = known is not None and known.device == rows.device and known.shape == rows.shape
    if same and known.data_ptr() == rows.data_ptr():
        return rows[0], grad._values()  # the weight holds `known`: this memory is its, distinct and sorted
    if grad.device.type == "cpu":
        rows = rows[0]
        if bool((rows[1:] > rows[:-1]).all()):  # strictly increasing: distinct and sorted, as coalesced
            return rows, grad._values()
    grad = grad.coalesce()
    return grad.indices()[0], grad.values()


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` (2-norm over all gradients) that also takes sparse gradients, which torch's
    refuses. Returns the total norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return torch.tensor(0.0)
    squares = []
    for param, grad in zip(params, grads, strict=True):
        values = sparse_rows(grad, param)[1] if grad.is_sparse else grad
        squares.append(torch.linalg.vector_norm(values.float()).square().to(grads[0].device))
    total = torch.stack(squares).sum().sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grad in grads:
        if grad.is_sparse:  # its values in place: `grad.mul_` would make new indices, which `sparse_rows` knows not
            grad._values().mul_(scale.to(grad.device))
        else:
            grad.mul_(scale.to(device=grad.device, dtype=grad.dtype))
    return total


def check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"recipe: {recipe!r} is not one of {', '.join(RECIPES)}")


def check_paper_arguments(args: TrainingArguments) -> None:
    """Raises, naming each field, where `args` differ from the reference recipe's `PAPER_ARGUMENTS`."""
    wrong = []
    for key, want in _PAPER_ARGUMENTS.items():
        got = getattr(args, key)
        got = getattr(got, "value", got)  # lr_scheduler_type is a SchedulerType
        if got != want:
            wrong.append(f"{key}={want!r} (got {got!r})")
    if wrong:
        raise ValueError(
            f"recipe='paper' is the reference code's optimizer and schedule; these TrainingArguments differ from it: "
            f"{', '.join(wrong)}. Build them as TrainingArguments(..., **stem_hf.training.PAPER_ARGUMENTS) (the same "
            "schedule spelled otherwise, e.g. with `min_lr`, counts as different)"
        )


def build_optimizer(
    model: nn.Module,
    args: TrainingArguments,
    table_lr: float | None = None,
    row_sparse_tables: bool = True,
    sharded: bool = False,
    recipe: str = "stem-hf",
    write_behind: bool = False,
) -> torch.optim.Optimizer:
    """The optimizer for `Trainer(..., optimizers=(build_optimizer(model, args), None))`: `param_groups` with
    `args.learning_rate`, `args.weight_decay`, `args.adam_beta1/2` and `args.adam_epsilon`, in `RowSparseAdamW`; or,
    with `sharded` (FSDP, which shards every parameter, tables included, along rows, so the row-sparse bookkeeping
    does not apply), in torch's AdamW over the same groups.

    `recipe="paper"`: the reference code's optimizer, torch's AdamW over one group of every trainable parameter at
    `args.weight_decay` (tables, norms and embeddings decayed alike) and the backbone's rate; `table_lr` and
    `row_sparse_tables` do not apply. `write_behind`: `RowSparseAdamW(write_behind=True)`, host tables written by a
    worker thread while the accelerator goes on."""
    check_recipe(recipe)
    if write_behind and (recipe == "paper" or sharded or not row_sparse_tables):
        raise ValueError("write_behind: only RowSparseAdamW's row-sparse table groups write behind")
    betas = (args.adam_beta1, args.adam_beta2)
    if recipe == "paper":
        if table_lr is not None:
            raise ValueError("recipe='paper' trains the tables at the backbone's learning rate: leave table_lr unset")
        params = [p for p in model.parameters() if p.requires_grad]
        group = {"name": "all", "params": params, "lr": args.learning_rate, "weight_decay": args.weight_decay}
        group["decay_tables"] = True  # on purpose: the model's optimizer check does not warn
        return torch.optim.AdamW([group], betas=betas, eps=args.adam_epsilon)
    row_sparse = row_sparse_tables and not sharded
    groups = param_groups(model, args.learning_rate, args.weight_decay, table_lr, 0.0, row_sparse)
    if sharded:
        return torch.optim.AdamW(groups, betas=betas, eps=args.adam_epsilon)
    return RowSparseAdamW(groups, betas=betas, eps=args.adam_epsilon, write_behind=write_behind)


# The `TrainingArguments.optim` values whose optimizer StemTrainer's is: torch's AdamW, fused or not (the default).
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")


class StemTrainer(Trainer):
    """`Trainer` that builds the optimizer of a training `recipe`.

    `recipe="stem-hf"` (the default) is this package's: `build_optimizer`'s groups, tables undecayed at `table_lr`
    (default: the learning rate), norms and biases undecayed, tables row-sparse (lazy AdamW: rows outside the batch
    keep their moments and do not move) unless `row_sparse_tables=False`; betas and schedule as `args` say (Trainer's
    defaults: (0.9, 0.999), linear decay to 0). Under FSDP (sharded DTensor parameters) it is torch's AdamW over the
    same groups. `recipe="paper"` is the reference code's: torch's AdamW over every parameter at `args.weight_decay`,
    tables included, dense table gradients and one clip over all gradients; `args` must hold `PAPER_ARGUMENTS`
    (betas (0.9, 0.95), decay 0.1, clip 1.0, cosine to a tenth of the peak rate), or it raises.

    `sparse_table_grads` makes table gradients sparse (`use_sparse_table_grads`: backward never builds a `[vocab, d_ff]`
    tensor) and clips with `clip_grad_norm`, for the length of `train()`: the model's tables are as they were before and
    after it. The default, None, turns them on where they are tested: one process, no FSDP, DeepSpeed, DataParallel or
    `fullgraph` compile, `row_sparse_tables`, the optimizer built here (not passed in), and a trainable table, float32
    or to be upcast by `train()` (`StemTables.upcast_for_training`). Compiled (`torch_compile`, an accelerate dynamo
    backend, a model passed in compiled), the tables' rows are gathered outside the graph, once per forward
    (`modeling_stem.rows_outside_graph`), which `fullgraph` forbids (an accelerate dynamo backend with `fullgraph`, or a
    model passed in as `torch.compile(model, fullgraph=True)`). True asks for them anyway (one process only, and not
    under a `fullgraph` compile); False keeps dense table gradients.

    `write_behind_tables` has the tables that sit in host memory updated by a worker thread while the accelerator goes
    on (`RowSparseAdamW(write_behind=True)`), with sparse table gradients only. The default, False, steps the tables
    before `optimizer.step()` returns: with the fused row update, writing in step measured faster on a GPU machine's
    host (`benchmarks/results/bench_gpu_h100.json`). Everything else is Trainer's."""

    def __init__(
        self,
        *args,
        table_lr: float | None = None,
        row_sparse_tables: bool | None = None,
        sparse_table_grads: bool | None = None,
        recipe: str = "stem-hf",
        write_behind_tables: bool = False,
        **kwargs,
    ):
        check_recipe(recipe)
        if not isinstance(write_behind_tables, bool):
            raise ValueError(f"write_behind_tables: True or False (default False), not {write_behind_tables!r}")
        if recipe == "paper":
            given = {
                "table_lr": table_lr is not None,
                "row_sparse_tables": row_sparse_tables is True,
                "sparse_table_grads": sparse_table_grads is True,
                "write_behind_tables": write_behind_tables is True,
                "optimizers": kwargs.get("optimizers", (None, None))[0] is not None,
            }
            given = [k for k, v in given.items() if v]
            if given:
                raise ValueError(
                    f"recipe='paper' is dense AdamW over every parameter at one learning rate: {', '.join(given)} "
                    "does not apply to it (use the default recipe for row-sparse tables)"
                )
            training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
            if training_args is not None:
                check_paper_arguments(training_args)  # before Trainer moves the model anywhere
            row_sparse_tables = sparse_table_grads = False
        row_sparse_tables = True if row_sparse_tables is None else row_sparse_tables
        self.table_lr, self.recipe = table_lr, recipe
        super().__init__(*args, **kwargs)
        if self.optimizer is None and self.args.optim not in ADAMW_OPTIMS:  # else AdamW would train in its place
            optim = getattr(self.args.optim, "value", self.args.optim)  # an OptimizerNames member
            raise ValueError(
                f"StemTrainer builds AdamW (RowSparseAdamW, or torch's under recipe='paper' and FSDP), but optim="
                f"{optim!r} asks for another optimizer: leave optim at its default, or train with a plain Trainer "
                "(optim=... applies there), or pass optimizers=(optimizer, None)"
            )
        if recipe == "paper":
            check_paper_arguments(self.args)
        unsupported = self.is_fsdp_enabled or self.is_deepspeed_enabled or self.args.world_size > 1
        unsupported = unsupported or self.args.n_gpu > 1  # DataParallel: one process, replicas
        if sparse_table_grads and unsupported:
            raise ValueError("sparse_table_grads: one process only (not tested with DDP, FSDP or DeepSpeed)")
        fullgraph = self._compiles_fullgraph()
        if sparse_table_grads and fullgraph:
            raise ValueError(
                "sparse_table_grads with a fullgraph compile (an accelerate dynamo backend with fullgraph, or a model "
                "passed in as torch.compile(model, fullgraph=True)): a compiled forward gathers the rows of tables "
                "with sparse gradients outside the graph, which fullgraph forbids; compile without fullgraph, or "
                "leave sparse_table_grads unset (dense table gradients under fullgraph)"
            )
        if sparse_table_grads is None:
            sparse_table_grads = (
                self._tables_can_take_sparse_grads()
                and self.optimizer is None  # one passed in may not take sparse gradients
                and row_sparse_tables
                and not unsupported
                and not fullgraph
            )
        self.row_sparse_tables = row_sparse_tables or sparse_table_grads  # sparse gradients need the row groups
        self.sparse_table_grads = sparse_table_grads
        if write_behind_tables and not (sparse_table_grads and self.optimizer is None):
            raise ValueError(
                "write_behind_tables: only with sparse table gradients and the optimizer StemTrainer builds (the "
                "worker writes the rows of sparse gradients)"
            )
        self.write_behind_tables = write_behind_tables

    def _compiles_fullgraph(self) -> bool:
        """Whether training compiles the model with `fullgraph`: through an accelerate dynamo backend (`accelerate
        launch --dynamo_use_fullgraph`, `ACCELERATE_DYNAMO_USE_FULLGRAPH`, which Trainer's accelerator takes up), or
        passed in as `torch.compile(model, fullgraph=True)` (a model compiled in place, `model.compile(...)`, shows
        nothing of it: its first step fails, saying what to do)."""
        plugin = getattr(self.accelerator.state, "dynamo_plugin", None)
        backend = getattr(plugin, "backend", None)
        dynamo = backend is not None and backend != DynamoBackend.NO
        passed = getattr(getattr(self.model, "dynamo_ctx", None), "fullgraph", False)
        return bool((dynamo and getattr(plugin, "fullgraph", False)) or passed is True)

    def _tables_can_take_sparse_grads(self) -> bool:
        """A trainable table, each in float32 or to be upcast by `train()`, none on the meta device."""
        trainable = [t for t in stem_tables(self.model) if t.weight.requires_grad]
        owners = [m for m in self.model.modules() if isinstance(m, StemTables)]
        upcast = all(m.upcast_for_training for m in owners)
        fp32_or_upcast = all(t.weight.dtype == torch.float32 or upcast for t in trainable)
        return bool(trainable) and fp32_or_upcast and all(t.weight.device.type != "meta" for t in trainable)

    def train(self, *args, **kwargs):
        tables = stem_tables(self.model)
        before = [table.sparse for table in tables]
        if self.sparse_table_grads:
            for module in self.model.modules():
                if isinstance(module, StemTables):
                    module.upcast_trainable()  # what model.train() does; sparse gradients need it first
        use_sparse_table_grads(self.model, enable=self.sparse_table_grads)
        # The loss is the model's own (no compute_loss of a subclass, no compute_loss_func): nothing else gives a table
        # a gradient, so host tables' gradients may cross behind the backward.
        own_loss = type(self).compute_loss is StemTrainer.compute_loss and self.compute_loss_func is None
        copy_table_grads_behind(self.model, enable=self.sparse_table_grads and own_loss)
        try:
            result = super().train(*args, **kwargs)
        except BaseException:
            with contextlib.suppress(Exception):
                self._settle_tables()  # the error raised is the one to see; the tables are left readable
            raise
        else:
            self._settle_tables()  # the tables are final when train() returns
            return result
        finally:
            copy_table_grads_behind(self.model, enable=False)
            for table, sparse in zip(tables, before, strict=True):
                table.sparse = sparse

    def _settle_tables(self) -> None:
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps it
        if isinstance(optimizer, RowSparseAdamW):
            optimizer.drop_row_views()  # settles first; the views would hold the tables' memory after train()

    def _clip_grad_norm(self, model):
        if not self.sparse_table_grads:
            return super()._clip_grad_norm(model)
        self.accelerator.unscale_gradients()  # what accelerate's clip_grad_norm_ does first (fp16 loss scaling)
        return clip_grad_norm(model.parameters(), self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None and self.sparse_table_grads:
            self.accelerator.unscale_gradients()
            grad_norm = clip_grad_norm(model.parameters(), float("inf"))
        return super()._get_grad_norm(model, grad_norm)

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            model = self.model if model is None else model
            # Trainer may build the optimizer before FSDP2 shards the model, so ask Trainer, not the parameters.
            sharded = self.is_fsdp_enabled or any(type(p).__name__ == "DTensor" for p in model.parameters())
            self.optimizer = build_optimizer(
                model,
                self.args,
                self.table_lr,
                self.row_sparse_tables,
                sharded,
                recipe=self.recipe,
                write_behind=self.write_behind_tables and not sharded,
            )
        return self.optimizer


# Attention, and every dense FFN projection: STEM layers have gate and down only, the other layers up_proj too.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_config(model: nn.Module, r: int = 8, lora_alpha: int = 16, token_ids: Iterable[int] | None = None, **kwargs):
    """A `peft.LoraConfig` for a STEM model: LoRA on `LORA_TARGETS`, and with `token_ids`, those rows of every table
    trained as deltas (PEFT's `trainable_token_indices`: the adapter stores only the rows, never a table copy).
    Other `LoraConfig` arguments pass through."""
    LoraConfig = require("peft").LoraConfig

    config = model.config
    if token_ids is not None:
        ids = sorted({int(i) for i in token_ids})
        bad = [i for i in ids if not 0 <= i < config.vocab_size]
        if bad:
            raise ValueError(f"token_ids: {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
        if not config.stem_layers:
            raise ValueError("token_ids: this model has no STEM layers, so no table rows to train")
        kwargs["trainable_token_indices"] = {f"stem_tables.{layer}": ids for layer in config.stem_layers}
    return LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM", **kwargs)


def adam_state_bytes(model: nn.Module, rows_seen: int | None = None) -> dict[str, int]:
    """Optimizer-state bytes of the options for `model` (which may be on the meta device): AdamW on every parameter
    (two fp32 moments each), and RowSparseAdamW with `rows_seen` rows per table holding state (default: all)."""
    tables = [p for n, p in model.named_parameters() if TABLE_KEY.search(n)]
    dense = sum(p.numel() for n, p in model.named_parameters() if not TABLE_KEY.search(n))
    table_elements = sum(p.numel() for p in tables)
    sparse_tables = sum(
        (min(rows_seen, p.shape[0]) if rows_seen is not None else p.shape[0]) * (2 * p.shape[1] + 1) * 4
        + p.shape[0] * 8
        for p in tables
    )
    return {
        "adamw_all": 8 * (dense + table_elements),
        "adamw_dense_only": 8 * dense,
        "row_sparse_tables": sparse_tables,
        "row_sparse_total": 8 * dense + sparse_tables,
    }


__all__ = [
    "LORA_TARGETS",
    "PAPER_ARGUMENTS",
    "PEFT_TABLE_KEY",
    "COMPILED_DENSE_MIN_ELEMENTS",
    "DENSE_STEP_BYTES",
    "FUSED_HOST_ROWS",
    "RECIPES",
    "ROWS_PER_WORKER",
    "ROW_CHUNK_ELEMENTS",
    "ROW_HEADROOM_STEPS",
    "RowSparseAdamW",
    "StemTrainer",
    "TableWrite",
    "adam_state_bytes",
    "adamw_dense",
    "adamw_rows",
    "build_optimizer",
    "check_paper_arguments",
    "check_recipe",
    "clip_grad_norm",
    "compiles_rows_by_default",
    "copy_table_grads_behind",
    "dense_settings",
    "lora_config",
    "param_groups",
    "rows_with_gradient",
    "sparse_rows",
    "use_sparse_table_grads",
]
