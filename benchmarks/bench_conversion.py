"""Held-out perplexity of SmolLM2-135M converted to STEM with each table initialization, before any healing, next to
the dense model's. Prints JSON. Usage: python benchmarks/bench_conversion.py [--ratios 1/3 1/2] [--calibration-tokens N]

Calibration and held-out text are disjoint documents of the bundled corpus (conversion/assets.py).
"""

import argparse
import json
import time

import torch

from conversion import convert, load_source
from conversion.assets import corpora, smollm2_gguf
from conversion.convert import chunk_texts, perplexity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", nargs="+", default=["1/3", "1/2"])
    parser.add_argument("--inits", nargs="+", default=["fitted", "mean", "projected", "xavier"])
    parser.add_argument("--calibration-tokens", type=int, default=50_000)
    parser.add_argument("--heldout-tokens", type=int, default=10_000)
    args = parser.parse_args()

    torch.set_flush_denormal(True)
    texts = corpora()
    dense, tokenizer = load_source(smollm2_gguf())
    heldout = chunk_texts(texts["heldout"], tokenizer, dense.config.bos_token_id, 512, args.heldout_tokens)
    dense_ppl = perplexity(dense, heldout)
    results = []
    for ratio in args.ratios:
        for init in args.inits:
            start = time.perf_counter()
            stem, report = convert(
                dense,
                stem_layers=ratio,
                init=init,
                calibration=texts["calibration"],
                calibration_tokens=args.calibration_tokens,
                tokenizer=tokenizer,
            )
            stem_ppl = perplexity(stem, heldout)
            results.append(
                {
                    "ratio": ratio,
                    "stem_layers": report["stem_layers"],
                    "init": init,
                    "perplexity": round(stem_ppl, 2),
                    "perplexity_over_dense": round(stem_ppl / dense_ppl, 3),
                    "calibration_tokens": report["calibration_tokens"],
                    "vocab_coverage": round(report["vocab_coverage"], 4),
                    "wall_time_s": round(time.perf_counter() - start, 1),
                }
            )
            print(json.dumps(results[-1]), flush=True)
    print(
        json.dumps(
            {
                "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
                "heldout_tokens": sum(len(c) for c in heldout),
                "dense_perplexity": round(dense_ppl, 2),
                "healing": "none",
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
