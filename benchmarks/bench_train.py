"""Training step time, peak memory and optimizer-state bytes: STEM vs the dense model of the same shape, AdamW vs
RowSparseAdamW for the tables. Each run is a fresh process (peak RSS is per process); all run side by side here.

    .venv/bin/python benchmarks/bench_train.py      # JSON on stdout and in benchmarks/results/bench_train.json

Then the optimizer-state bytes of each option at the paper's 1B shape (Llama-3.2-1B, STEM-1/2), from the formula
that the measured runs check.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from stem_hf import StemConfig, StemForCausalLM
from stem_hf.accounting import flops_per_token
from stem_hf.demo import PAPER_1B
from stem_hf.training import RowSparseAdamW, adam_state_bytes, clip_grad_norm, param_groups, use_sparse_table_grads

SHAPE = dict(
    vocab_size=32000,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    table_dtype="float32",
)
BATCH, LENGTH, WARMUP, STEPS = 8, 256, 2, 8
RUNS = [
    ("dense", "adamw"),
    ("1/2", "adamw"),
    ("1/2", "row_sparse"),
    ("1/2", "row_sparse+sparse_grads"),
    ("full", "adamw"),
    ("full", "row_sparse"),
    ("full", "row_sparse+sparse_grads"),
]


def worker(stem_layers: str, optimizer_name: str) -> dict:
    torch.manual_seed(0)
    model = StemForCausalLM(StemConfig(**SHAPE, stem_layers=[] if stem_layers == "dense" else stem_layers)).train()
    if optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(param_groups(model, lr=1e-3, weight_decay=0.1), lr=1e-3)
    else:
        optimizer = RowSparseAdamW(param_groups(model, lr=1e-3, weight_decay=0.1, row_sparse_tables=True))
    if optimizer_name.endswith("sparse_grads"):
        use_sparse_table_grads(model)
    # Token ids drawn from a Zipf-like law over the vocabulary, as text is: batches repeat frequent tokens.
    ranks = torch.arange(1, SHAPE["vocab_size"] + 1, dtype=torch.float64)
    weights = 1 / ranks
    g = torch.Generator().manual_seed(0)
    batches = [torch.multinomial(weights, BATCH * LENGTH, True, generator=g).view(BATCH, LENGTH) for _ in range(STEPS)]
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for step in range(WARMUP + STEPS):
        ids = batches[step % STEPS]
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        clip_grad_norm(model.parameters(), 1.0)  # as Trainer clips (this one also takes sparse gradients)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    tensors = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    state = sum(v.numel() * v.element_size() for v in tensors)
    seen = len(torch.unique(torch.cat([b.flatten() for b in batches])))
    return {
        "stem_layers": stem_layers,
        "optimizer": optimizer_name,
        "median_step_s": statistics.median(times),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_rss_growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024,
        "optimizer_state_mb": state / 1e6,
        "distinct_tokens_seen": seen,
        "params": model.num_parameters(),
        "flops_per_token": flops_per_token(model.config, LENGTH),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("STEM_LAYERS", "OPTIMIZER"))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    runs = []
    for stem_layers, optimizer in RUNS:
        command = [sys.executable, __file__, "--worker", stem_layers, optimizer]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(runs[-1]), file=sys.stderr)
    dense = runs[0]
    for run in runs:
        run["step_time_over_dense"] = run["median_step_s"] / dense["median_step_s"]
        run["flops_over_dense"] = run["flops_per_token"] / dense["flops_per_token"]
        run["peak_rss_over_dense"] = run["peak_rss_mb"] / dense["peak_rss_mb"]
    with torch.device("meta"):
        paper = StemForCausalLM(StemConfig(**PAPER_1B, stem_layers="1/2", table_dtype="float32"))
    paper_state = {
        f"rows_seen_{n or 'all'}": {k: v / 1e9 for k, v in adam_state_bytes(paper, n).items()}
        for n in (10_000, 50_000, None)
    }
    result = {
        "shape": SHAPE,
        "batch": [BATCH, LENGTH],
        "runs": runs,
        "paper_1b_stem_half_optimizer_state_gb": paper_state,
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(result, indent=2))
    with open("benchmarks/results/bench_train.json", "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
