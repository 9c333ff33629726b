"""Forward (prefill) time of STEM vs the dense model of the same shape, measured side by side in one process.

STEM removes the up-projection matmul of each STEM layer and adds a row gather; the measured speedup should track the
FLOPs it removes. Prints JSON and saves it (benchmarks/results/bench_forward.json).

Usage: python benchmarks/bench_forward.py [--repeats 5] [--seq-len 512]
"""

import argparse
import json
import os
import statistics
import time

import torch
from tqdm import tqdm

from stem_hf import StemConfig, StemForCausalLM
from stem_hf.accounting import flops_per_token, num_active_parameters

SHAPE = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=2048,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/bench_forward.json", help="where the JSON goes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()

    torch.manual_seed(0)
    variants = {"dense": "", "1/3": "1/3", "1/2": "1/2", "full": "full"}
    models = {name: StemForCausalLM(StemConfig(**SHAPE, stem_layers=spec)).eval() for name, spec in variants.items()}
    input_ids = torch.randint(0, SHAPE["vocab_size"], (args.batch_size, args.seq_len))
    times = {name: [] for name in models}
    with torch.inference_mode():
        for model in models.values():  # warm-up
            model(input_ids)
        # Interleave the variants so drift in machine load hits all of them alike.
        for _ in tqdm(range(args.repeats), desc="repeats"):
            for name, model in models.items():
                start = time.perf_counter()
                model(input_ids)
                times[name].append(time.perf_counter() - start)

    dense_time = statistics.median(times["dense"])
    context = (args.seq_len + 1) / 2
    dense_flops = flops_per_token(models["dense"].config, context)
    report = {
        "shape": SHAPE,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "results": {},
    }
    for name, model in models.items():
        median = statistics.median(times[name])
        report["results"][name] = {
            "stem_layers": model.config.stem_layers,
            "median_s": round(median, 4),
            "tokens_per_s": round(args.batch_size * args.seq_len / median, 1),
            "speedup_vs_dense": round(dense_time / median, 3),
            "flops_ratio_vs_dense": round(flops_per_token(model.config, context) / dense_flops, 3),
            "speedup_predicted_by_flops": round(dense_flops / flops_per_token(model.config, context), 3),
            "total_params": model.num_parameters(),
            "active_params_per_token": num_active_parameters(model),
        }
    print(json.dumps(report, indent=2))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        f.write(json.dumps(report, indent=2) + "\n")
    os.replace(args.out + ".tmp", args.out)  # whole or not at all


if __name__ == "__main__":
    main()
