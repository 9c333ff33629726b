"""Load time and memory of a STEM checkpoint with >= 4 GB of tables: memory-mapped load vs eager read vs the same model
without tables, each in a fresh subprocess, then a forward over 2,048 tokens. Prints JSON and saves
it (benchmarks/results/bench_load.json).

Usage: python benchmarks/bench_load.py [--vocab-size 131072] [--intermediate-size 4096] [--stem-layers 4] [--out DIR]

Before each run the checkpoint is evicted from the page cache (posix_fadvise DONTNEED), so every load reads from disk
as after a reboot, and the table pages a forward maps in are the ones it read. The forward uses 2,048 token ids drawn
uniformly from the vocabulary: more distinct rows than text of that length would touch.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

TOKENS = 2048


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _table_resident_bytes() -> int:
    """Resident bytes of this process's mappings of table files (pages a forward actually read)."""
    total, in_table = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and fields[0][0] in "0123456789abcdef":
                in_table = len(fields) >= 6 and "stem-tables-" in fields[-1]
            elif in_table and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def _status() -> dict:
    """Peak (VmHWM, reset at exec unlike ru_maxrss), anonymous and file-backed resident bytes of this process."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("VmHWM", "RssAnon", "RssFile")))
    return {k: int(v.split()[0]) * 1024 for k, v in fields.items()}


def _evict(folder: str) -> None:
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def child(mode: str, folder: str) -> None:
    """One measurement in a fresh interpreter: load, then a forward over TOKENS tokens."""
    from stem_hf import StemConfig, StemForCausalLM

    torch.set_num_threads(max(1, os.cpu_count() // 2))
    # A first forward maps torch's own library code; do it on a tiny model so RSS growth below is what the measured
    # model costs. That growth includes the dense weights (memory-mapped too: here mostly a 131k-row embedding and LM
    # head); what the tables cost is the growth beyond the no-tables model's, and their resident pages.
    tiny = StemConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    with torch.inference_mode():
        StemForCausalLM(tiny)(torch.randint(0, 64, (1, TOKENS)), logits_to_keep=1)
    before, status_before = _rss(), _status()
    start = time.perf_counter()
    model = StemForCausalLM.from_pretrained(folder, disable_mmap=(mode == "eager"))
    load_s = time.perf_counter() - start
    after_load = _rss()
    input_ids = torch.randint(0, model.config.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    with torch.inference_mode():
        model(input_ids, logits_to_keep=1)
    forward_s = time.perf_counter() - start
    print(
        json.dumps(
            {
                "load_s": load_s,
                "forward_s": forward_s,
                "rss_growth_load": after_load - before,
                "rss_growth_load_and_forward": _rss() - before,
                "peak_rss": _status()["VmHWM"],
                "peak_rss_growth": _status()["VmHWM"] - status_before["VmHWM"],
                "table_bytes_resident_after_forward": _table_resident_bytes(),
                "rss_anon_growth_load_and_forward": _status()["RssAnon"] - status_before["RssAnon"],
                "rss_file_growth_load_and_forward": _status()["RssFile"] - status_before["RssFile"],
                "distinct_tokens": int(input_ids.unique().numel()),
            }
        )
    )


def measure(mode: str, folder: str) -> dict:
    _evict(folder)
    out = subprocess.run([sys.executable, __file__, "--child", mode, folder], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=131072)
    parser.add_argument("--intermediate-size", type=int, default=4096)
    parser.add_argument("--stem-layers", type=int, default=4, help="number of STEM layers (the model has one more)")
    parser.add_argument("--out", default=None, help="keep the checkpoints here and reuse them (default: a temp folder)")
    parser.add_argument(
        "--json", default="benchmarks/results/bench_load.json", help="where the JSON goes", dest="json_out"
    )
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)

    from tqdm import tqdm

    from stem_hf import StemConfig, StemForCausalLM

    shape = dict(
        vocab_size=args.vocab_size,
        hidden_size=256,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.stem_layers + 1,
        num_attention_heads=4,
        max_position_embeddings=TOKENS,
    )
    root = args.out or tempfile.mkdtemp(prefix="stem-bench-load-")
    folders = {"stem": os.path.join(root, "stem"), "no_tables": os.path.join(root, "no-tables")}
    try:
        for name, layers in tqdm([("stem", "full"), ("no_tables", "")], desc="building and saving"):
            if os.path.isfile(os.path.join(folders[name], "model.safetensors.index.json")):
                continue  # reuse the checkpoints of an earlier run with the same --out
            torch.manual_seed(0)
            StemForCausalLM(StemConfig(**shape, stem_layers=layers)).save_pretrained(folders[name])
        table_bytes = sum(
            os.path.getsize(os.path.join(folders["stem"], f))
            for f in os.listdir(folders["stem"])
            if f.startswith("stem-tables-")
        )
        runs = {}
        for mode, folder in tqdm([("mmap", "stem"), ("eager", "stem"), ("no_tables", "no_tables")], desc="loading"):
            runs[mode] = measure("eager" if mode == "eager" else "mmap", folders[folder])
    finally:
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)

    mmap, eager, base = runs["mmap"], runs["eager"], runs["no_tables"]
    report = {
        "shape": shape,
        "stem_layers": list(range(1, args.stem_layers + 1)),
        "table_bytes": table_bytes,
        "forward_tokens": TOKENS,
        "runs": runs,
        "ratios": {
            "mmap_rss_growth_after_load_and_forward_over_table_bytes": mmap["rss_growth_load_and_forward"]
            / table_bytes,
            "mmap_rss_growth_beyond_no_tables_model_over_table_bytes": (
                mmap["rss_growth_load_and_forward"] - base["rss_growth_load_and_forward"]
            )
            / table_bytes,
            "mmap_table_pages_resident_over_table_bytes": mmap["table_bytes_resident_after_forward"] / table_bytes,
            "mmap_peak_rss_growth_over_table_bytes": mmap["peak_rss_growth"] / table_bytes,
            "eager_peak_rss_growth_over_table_bytes": eager["peak_rss_growth"] / table_bytes,
            "eager_over_mmap_peak_rss": eager["peak_rss"] / mmap["peak_rss"],
            "mmap_load_time_over_no_tables": mmap["load_s"] / base["load_s"],
            "eager_load_time_over_mmap": eager["load_s"] / mmap["load_s"],
        },
    }
    print(json.dumps(report, indent=2))
    os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
    with open(args.json_out + ".tmp", "w") as f:
        f.write(json.dumps(report, indent=2) + "\n")
    os.replace(args.json_out + ".tmp", args.json_out)  # whole or not at all


if __name__ == "__main__":
    main()
