"""lm-eval on a dense source and on its STEM conversion, side by side, on the shipped offline tasks (`stem_offline`:
multiple choice, greedy completion, rolling perplexity), with the held-out perplexity of the conversion report.

    make demo && .venv/bin/python benchmarks/bench_eval.py

Both models read their inputs through the converted checkpoint's tokenizer, which prepends BOS (as calibration did),
so the two see identical token ids. The STEM results are also merged into the checkpoint's `lm_eval_results.json`
and its model card is refreshed.
"""

import argparse
import json
import os
import time

import torch
from transformers import AutoTokenizer

from stem_hf.checkpoint_stem import REPORT_FILE, RESULTS_FILE
from stem_hf.conversion.sources import load_source
from stem_hf.evaluation import evaluate, headline_metrics, load_for_eval
from stem_hf.model_card import write_model_card


def _timed_eval(model, tasks, tokenizer, output=None) -> tuple[dict, float]:
    start = time.perf_counter()
    results = evaluate(model, tasks, tokenizer, output=output)
    return headline_metrics(results), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="runs/demo/stem-1-3", help="a converted STEM checkpoint")
    parser.add_argument("--source", help="its dense source (default: the one its conversion report names)")
    parser.add_argument("--tasks", default="stem_offline")
    parser.add_argument("--out", default="benchmarks/results/bench_eval.json")
    args = parser.parse_args()
    torch.set_flush_denormal(True)  # dequantized GGUF weights hold denormals, which slow CPU matmuls

    with open(os.path.join(args.checkpoint, REPORT_FILE)) as f:
        report = json.load(f)
    tasks = args.tasks.split(",")
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    dense, _ = load_source(args.source or report["source"])
    dense_metrics, dense_s = _timed_eval(dense.eval(), tasks, tokenizer)
    del dense
    stem, _ = load_for_eval(args.checkpoint)
    stem_metrics, stem_s = _timed_eval(stem, tasks, tokenizer, os.path.join(args.checkpoint, RESULTS_FILE))
    write_model_card(args.checkpoint)

    rows = {}
    for task, metrics in dense_metrics.items():
        for metric, dense_value in metrics.items():
            stem_value = stem_metrics[task][metric]
            rows[f"{task} {metric}"] = {
                "dense": dense_value,
                "stem": stem_value,
                "stem_over_dense": stem_value / dense_value if dense_value else None,
            }
    result = {
        "checkpoint": args.checkpoint,
        "source": args.source or report["source"],
        "stem_layers": report["stem_layers"],
        "heal_tokens": report.get("heal_tokens", 0),
        "tasks": tasks,
        "lm_eval": rows,
        "heldout_perplexity": {
            "tokens": report.get("heldout_tokens"),
            "dense": report.get("heldout_perplexity_dense"),
            "stem": report.get("heldout_perplexity_stem"),
            "stem_over_dense": report.get("perplexity_ratio"),
        },
        "eval_seconds": {"dense": dense_s, "stem": stem_s},
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(result, indent=2))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f, indent=2)
    os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
