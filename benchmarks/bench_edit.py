"""Knowledge editing on the SmolLM2-135M STEM-1/3 of `make demo`: efficacy and locality of each strategy on the
project's 34 country-capital pairs (`stem_hf.edit_eval`).

    make demo && .venv/bin/python benchmarks/bench_edit.py   # JSON on stdout and in benchmarks/results/bench_edit.json
"""

import argparse
import json

import torch
from transformers import AutoTokenizer

from stem_hf import StemForCausalLM
from stem_hf.edit_eval import evaluate_edits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="runs/demo/stem-1-3")
    parser.add_argument("--out", default="benchmarks/results/bench_edit.json")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    model = StemForCausalLM.from_pretrained(args.checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    result = {"checkpoint": args.checkpoint, **evaluate_edits(model, tokenizer)}
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
