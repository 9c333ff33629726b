"""The host side of serving tables from host memory: gathering one forward's distinct rows, at the GPU benchmark's 0.75B
shape (vocab 32000, d_ff 5632, bf16; the batch's 8 x 1024 ids, uniform and Zipf), as `bench_gpu.py` times it end to
end on a GPU. Four ways, paired in rounds:

- `index_select`: `torch.index_select` on the offload engine's token-major store (`StemHostTables`, `[vocab, layers,
  d_ff]`: a row is a token's rows over every STEM layer), what the engine's one gather did before `gather_rows`;
- `gather_rows`: the same rows by `gather_rows` (rows cut in pieces below index_select's grain), what the one gather
  does now (a decoding step, a planned chunk, a row cache's misses);
- `store_per_layer`: one gather per STEM layer from the store's strided slot of that layer, what the engine's
  pipelined prefill does (`StemPipelinedRows`, a layer at a time ahead of the layers);
- `per_layer`: one gather per STEM layer from its own `[vocab, d_ff]` table, the model's own host path.

torch's CPU index_select copies a row of at least `INDEX_SELECT_GRAIN` elements (6 x 5632 = 33792 here) with a parallel
copy of its own, a thread-pool round trip per row, so its cost grows with threads: timed at each of `--threads`.
`GBps` counts the rows' bytes. Saves JSON after each STEM ratio (`complete` once all are in).

    python benchmarks/bench_host_gather.py          # benchmarks/results/bench_host_gather.json: a minute
    python benchmarks/bench_host_gather.py --repeats 3 --out benchmarks/results/bench_host_gather_gpu.json  # gpu_check
    python benchmarks/bench_host_gather.py --vocab 600 --batch-size 2 --seq-len 64 --repeats 1 --out /tmp/g.json
"""

import argparse
import os
import statistics
from functools import partial

import torch
from bench_gpu import SHAPES, VOCAB, paired_s, save, token_ids
from tqdm import tqdm

from stem_hf.cli_args import positive_int, positive_ints
from stem_hf.modeling_stem import INDEX_SELECT_GRAIN, gather_rows
from stem_hf.offload import StemHostTables

LAYERS = {"1/2": 6, "full": 12}  # the STEM layers of the 0.75B shape's 12


def paired_ms(fns: dict, repeats: int) -> dict[str, float]:
    """Median milliseconds of each of `fns`, timed in turn over `repeats` rounds (`bench_gpu.paired_s`)."""
    times = paired_s(list(fns.values()), repeats, torch.device("cpu"))
    return {name: statistics.median(t) * 1e3 for name, t in zip(fns, times, strict=True)}


def gather_per_layer(tables: list[torch.Tensor], ids: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """Each layer's rows of `ids` as the per-layer fetches gather them (`fetch_rows`)."""
    for table, out in zip(tables, outs, strict=True):
        gather_rows(table, ids, out=out)


def run(spec: str, args) -> dict:
    layers, vocab, d_ff = LAYERS[spec], args.vocab, args.d_ff
    tables = {}
    for layer in range(layers):  # every page written (an untouched one reads as the kernel's one zero page)
        row_value = torch.arange(vocab, dtype=torch.float32)[:, None] % 251 + layer  # rows told apart by value
        tables[layer] = torch.empty((vocab, d_ff), dtype=torch.bfloat16).copy_(row_value.expand(vocab, d_ff))
    store = StemHostTables(tables)
    out = {"layers": layers, "row_elements": layers * d_ff, "grain": INDEX_SELECT_GRAIN}
    for kind in ("uniform", "zipf"):
        ids = token_ids(kind, (args.batch_size, args.seq_len), vocab, torch.device("cpu")).view(-1)
        unique = torch.unique(ids)
        staging = torch.empty((len(unique), layers, d_ff), dtype=torch.bfloat16)
        per_layer = [torch.empty((len(unique), d_ff), dtype=torch.bfloat16) for _ in range(layers)]
        fns = {
            "index_select": partial(torch.index_select, store.data, 0, unique, out=staging),
            "gather_rows": partial(gather_rows, store.data, unique, out=staging),
            "store_per_layer": partial(gather_per_layer, [store.data[:, i] for i in range(layers)], unique, per_layer),
            "per_layer": partial(gather_per_layer, list(tables.values()), unique, per_layer),
        }
        gathered = gather_rows(store.data, unique)
        if not torch.equal(gathered, torch.index_select(store.data, 0, unique)):
            raise AssertionError("gather_rows gathered other rows than index_select")
        fns["store_per_layer"]()
        if not all(torch.equal(per_layer[i], gathered[:, i]) for i in range(layers)):
            raise AssertionError("the store's per-layer gathers gathered other rows")
        gb = staging.numel() * staging.element_size() / 1e9
        row = {"distinct_ids": len(unique), "gathered_mb": round(gb * 1e3, 1)}
        for threads in args.threads:
            torch.set_num_threads(threads)
            ms = paired_ms(fns, args.repeats)
            row[f"threads_{threads}"] = {
                **{f"{name}_ms": round(t, 2) for name, t in ms.items()},
                **{f"{name}_GBps": round(gb / t * 1e3, 2) for name, t in ms.items()},
                "gather_rows_over_index_select": round(ms["index_select"] / ms["gather_rows"], 2),
                "index_select_us_per_id": round(ms["index_select"] * 1e3 / len(unique), 2),
                "gather_rows_us_per_id": round(ms["gather_rows"] * 1e3 / len(unique), 2),
            }
        out[kind] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=positive_int, default=VOCAB["0.75b"])
    parser.add_argument("--d-ff", type=positive_int, default=SHAPES["0.75b"]["intermediate_size"])
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--seq-len", type=positive_int, default=1024)
    parser.add_argument("--repeats", type=positive_int, default=5)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parser.add_argument("--threads", type=positive_ints, default=sorted({1, cores}), help="comma-separated")
    parser.add_argument("--out", default="benchmarks/results/bench_host_gather.json")
    args = parser.parse_args()
    report = {
        "torch": torch.__version__,
        "vocab": args.vocab,
        "d_ff": args.d_ff,
        "cores": cores,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "repeats": args.repeats,
    }
    for spec in tqdm(LAYERS, desc="host gather"):
        report[spec] = run(spec, args)
        save({**report, "complete": False}, args.out)  # what a run stopped midway measured stays
    report["complete"] = True
    save(report, args.out)
    print(report)


if __name__ == "__main__":
    main()
