"""What save ids cost a save: `save_pretrained` of a STEM model (dense shards re-stamped with the id, a second write
of the dense bytes), side by side with the same save's steps timed alone in the same run: transformers writing the
dense shards, the tables, and the re-stamp of the dense shards.

    .venv/bin/python benchmarks/bench_save.py   # JSON in benchmarks/results/bench_save.json
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from stem_hf import StemConfig, StemForCausalLM
from stem_hf.checkpoint_stem import SAVE_ID_KEY, stamp_safetensors

# About 720 MB of fp32 dense weights (embedding and head untied) and 540 MB of bf16 tables.
SHAPE = dict(
    vocab_size=32768,
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    stem_layers=[2, 6],
    table_dtype="bfloat16",
)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/bench_save.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = StemForCausalLM(StemConfig(**SHAPE)).eval()
    state = model.state_dict()
    dense = {k: v.contiguous() for k, v in state.items() if "stem_tables" not in k}
    tables = {k: v.contiguous() for k, v in state.items() if "stem_tables" in k}
    runs = []
    with tempfile.TemporaryDirectory(dir=".") as root:  # on the repository's disk, where checkpoints usually go
        for i in range(args.repeats):
            folder = Path(root) / f"save-{i}"
            dense_file, tables_file = Path(root) / f"dense-{i}.safetensors", Path(root) / f"tables-{i}.safetensors"
            run = {
                "save_pretrained_s": timed(lambda folder=folder: model.save_pretrained(folder)),
                "dense_write_alone_s": timed(lambda f=dense_file: save_file(dense, f, metadata={"format": "pt"})),
                "tables_write_alone_s": timed(lambda f=tables_file: save_file(tables, f, metadata={"format": "pt"})),
                "restamp_dense_alone_s": timed(lambda f=dense_file: stamp_safetensors(str(f), {SAVE_ID_KEY: "x" * 32})),
            }
            runs.append(run)
            print(json.dumps(run))
            for path in (dense_file, tables_file):
                os.remove(path)
    mean = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
    dense_bytes = sum(v.numel() * v.element_size() for v in dense.values())
    table_bytes = sum(v.numel() * v.element_size() for v in tables.values())
    result = {
        "shape": SHAPE,
        "dense_bytes": dense_bytes,
        "table_bytes": table_bytes,
        "repeats": args.repeats,
        "runs": runs,
        "mean_s": mean,
        "restamp_share_of_save": mean["restamp_dense_alone_s"] / mean["save_pretrained_s"],
        "restamp_over_dense_write": mean["restamp_dense_alone_s"] / mean["dense_write_alone_s"],
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
