"""The host side of training with tables in host memory: `RowSparseAdamW`'s step of the tables, on this machine's CPU.

At the issue's 0.75B shape (tables of 32000 x 5632, float32 as training holds them) and a batch of 8 x 1024 tokens,
uniform or Zipf-distributed:

- `row_step`: one table's step seven ways, timed in turn round by round on the same batches: `fused`, each row in
  place by torch's fused CPU AdamW kernel (`FUSED_HOST_ROWS`, the default for float32 tables), the rows shared out to
  serial worker threads; `fused_full_scan`, the same with every gradient value read to tell the rows with gradient
  (what `rows_with_gradient` did before it read a row's first value first); `fused_one_call`, the same kernel in one
  call from the stepping thread, and `fused_one_call_other_thread` stepped from a thread of its own, as the table
  writer does; `chunked`, rows gathered, updated by torch's elementwise operations and scattered back in cache-sized
  chunks (`ROW_CHUNK_ELEMENTS`, what bf16 tables take); `one_pass`, the chunked update over all of the batch's rows at
  once; `compiled`, the rows' gather, update and scatter by one function compiled by inductor
  (`RowSparseAdamW(compiled_rows=True)`, which applies to tables on an accelerator: the table is taken for one here),
  compiled in the warm-up steps.
- `write_behind`: three tables' steps, fused and chunked; how long `step()` holds the calling thread (the one that
  would launch the accelerator's work) when it writes the rows itself and when a worker writes them behind, and how
  long until the rows are written.

    .venv/bin/python benchmarks/bench_row_step.py --repeats 7     # JSON in benchmarks/results/bench_row_step.json

How much of the writing a GPU hides is `bench_gpu.py`'s `host_row_sparse_adamw_write_behind` (it needs a GPU).
"""

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from stem_hf import training
from stem_hf.training import RowSparseAdamW

VOCAB, D_FF, TOKENS = 32000, 5632, 8 * 1024


def batch_rows(kind: str, seed: int) -> torch.Tensor:
    """The distinct ids of a batch of `TOKENS` tokens: uniform, or Zipf (rank r drawn with weight 1/r^1.1)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        ids = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    else:
        weights = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64) ** 1.1
        ids = torch.multinomial(weights, TOKENS, replacement=True, generator=g)
    return ids.unique()


def sparse_grad(rows: torch.Tensor, seed: int) -> torch.Tensor:
    values = torch.randn(len(rows), D_FF, generator=torch.Generator().manual_seed(seed)) * 1e-3
    return torch.sparse_coo_tensor(rows[None], values, (VOCAB, D_FF), is_coalesced=True, check_invariants=False)


def tables(n: int) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.randn(VOCAB, D_FF) * 0.02) for _ in range(n)]
    for param in params:
        param.stem_reads_wait = True  # as `StemTables.train()` marks a model's tables (only this script reads these)
    return params


def full_scan(values: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(values, 0, dim=1) > 0


def run_row_step(kind: str, repeats: int, warmup: int) -> dict:
    """One table, each way in turn on the same batches (each its own table and state)."""
    variants = {  # FUSED_HOST_ROWS, ROW_CHUNK_ELEMENTS, ROWS_PER_WORKER, stepped from a thread of its own
        "fused": (True, training.ROW_CHUNK_ELEMENTS, training.ROWS_PER_WORKER, False),
        "fused_full_scan": (True, training.ROW_CHUNK_ELEMENTS, training.ROWS_PER_WORKER, False),
        "fused_one_call": (True, training.ROW_CHUNK_ELEMENTS, 1 << 62, False),
        "fused_one_call_other_thread": (True, training.ROW_CHUNK_ELEMENTS, 1 << 62, True),
        "chunked": (False, training.ROW_CHUNK_ELEMENTS, training.ROWS_PER_WORKER, False),
        "one_pass": (False, 1 << 62, training.ROWS_PER_WORKER, False),
        "compiled": (False, training.ROW_CHUNK_ELEMENTS, training.ROWS_PER_WORKER, False),  # `compiled_rows=True`
    }
    defaults = training.FUSED_HOST_ROWS, training.ROW_CHUNK_ELEMENTS, training.ROWS_PER_WORKER
    in_host_memory, rows_with_gradient = training._in_host_memory, training.rows_with_gradient
    other_thread = ThreadPoolExecutor(1, thread_name_prefix="bench-writer")  # as the table writer steps its tables
    (start,) = tables(1)
    params = {name: torch.nn.Parameter(start.detach().clone()) for name in variants}
    del start
    optimizers = {
        k: RowSparseAdamW([{"params": [p], "row_sparse": True}], lr=1e-3, compiled_rows=k == "compiled")
        for k, p in params.items()
    }
    times = {k: [] for k in variants}
    # Warm-up steps: the slots exist and most rows have been updated once (the fused update makes a row's views then),
    # as in a run already going.
    for step in range(repeats + warmup):
        rows = batch_rows(kind, step)
        order = list(variants)[step % len(variants) :] + list(variants)[: step % len(variants)]
        for name in order:
            params[name].grad = sparse_grad(rows, step)
            *settings, elsewhere = variants[name]
            training.FUSED_HOST_ROWS, training.ROW_CHUNK_ELEMENTS, training.ROWS_PER_WORKER = settings
            # `compiled_rows` applies to tables on an accelerator: this host table is taken for one, to time it here.
            training._in_host_memory = (lambda param: False) if name == "compiled" else in_host_memory
            training.rows_with_gradient = full_scan if name == "fused_full_scan" else rows_with_gradient
            start = time.perf_counter()
            if elsewhere:
                other_thread.submit(optimizers[name].step).result()
            else:
                optimizers[name].step()
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
    training._in_host_memory, training.rows_with_gradient = in_host_memory, rows_with_gradient
    training.FUSED_HOST_ROWS, training.ROW_CHUNK_ELEMENTS, training.ROWS_PER_WORKER = defaults
    other_thread.shutdown()
    out = {"rows": len(batch_rows(kind, 0)), "chunk_rows": max(1, variants["chunked"][1] // D_FF)}
    for name, seconds in times.items():
        out[f"{name}_ms"] = round(statistics.median(seconds) * 1e3, 1)
    out["fused_speedup_over_chunked"] = round(out["chunked_ms"] / out["fused_ms"], 2)
    out["fused_speedup_over_full_scan"] = round(out["fused_full_scan_ms"] / out["fused_ms"], 2)
    out["chunked_speedup_over_one_pass"] = round(out["one_pass_ms"] / out["chunked_ms"], 2)
    torch.testing.assert_close(params["chunked"], params["one_pass"], rtol=0, atol=0)  # the same update, bit for bit
    for name in ("fused_full_scan", "fused_one_call", "fused_one_call_other_thread"):  # the same kernel and rows
        torch.testing.assert_close(params[name], params["fused"], rtol=0, atol=0)
    torch.testing.assert_close(params["compiled"], params["chunked"], rtol=1e-5, atol=1e-6)
    # The fused kernel's own order of operations: equal to rounding, not bit for bit.
    out["fused_max_abs_diff"] = float((params["fused"] - params["chunked"]).abs().max().detach())
    torch.testing.assert_close(params["fused"], params["chunked"], rtol=1e-5, atol=1e-6)
    return out


def run_write_behind(repeats: int, warmup: int, n_tables: int = 3) -> dict:
    """`n_tables` tables stepped together, in step and then behind (the same batches, fresh tables and state), with the
    fused update (its rows shared out to serial worker threads) and with the chunked one."""
    out = {"tables": n_tables}
    defaults = training.FUSED_HOST_ROWS
    for update, fused in (("fused", True), ("chunked", False)):
        training.FUSED_HOST_ROWS = fused
        out[update] = {}
        for behind in (False, True):
            params = tables(n_tables)
            optimizer = RowSparseAdamW([{"params": params, "row_sparse": True}], lr=1e-3, write_behind=behind)
            returns, written = [], []
            for step in range(repeats + warmup):
                optimizer.settle()
                rows = batch_rows("uniform", step)
                for i, param in enumerate(params):
                    param.grad = sparse_grad(rows, 100 * step + i)
                start = time.perf_counter()
                optimizer.step()
                returned = time.perf_counter()
                optimizer.settle()
                if step >= warmup:
                    returns.append(returned - start)
                    written.append(time.perf_counter() - start)
            out[update]["behind" if behind else "in_step"] = {
                "step_returns_ms": round(statistics.median(returns) * 1e3, 1),
                "rows_written_ms": round(statistics.median(written) * 1e3, 1),
            }
            del params, optimizer
        timed = out[update]
        timed["calling_thread_freed_ms"] = round(
            timed["in_step"]["step_returns_ms"] - timed["behind"]["step_returns_ms"], 1
        )
    training.FUSED_HOST_ROWS = defaults
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=12, help="steps before the timed ones")
    parser.add_argument("--out", default="benchmarks/results/bench_row_step.json")
    args = parser.parse_args()
    report = {
        "shape": {"vocab": VOCAB, "d_ff": D_FF, "tokens": TOKENS, "table_dtype": "float32"},
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "row_step": {kind: run_row_step(kind, args.repeats, args.warmup) for kind in ("uniform", "zipf")},
        "write_behind": run_write_behind(args.repeats, args.warmup),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        f.write(json.dumps(report, indent=2) + "\n")
    os.replace(args.out + ".tmp", args.out)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
