"""Where the time goes: `torch.profiler` over one prefill (dense, STEM-full resident, STEM-1/2 with host tables and
through `StemOffloadEngine`), one train step (dense and STEM-1/2 resident with `RowSparseAdamW`, STEM-1/2 with host
tables) and a greedy decode of 16 tokens at batch 64 (dense, STEM-1/2 resident and host) at `bench_gpu.py`'s shapes.
Saves, per variant, the step's wall time, the device's kernel time, the operators' own host time, the matrix products'
device time, and the operators that take the most device time and the most host time; and, per STEM variant profiled
beside its dense one, what STEM saves in matrix products and the speedup those alone would give (`bounds`: how far
the FLOPs STEM removes can carry where matrix products are only part of a step).

    python benchmarks/profile_gpu.py                          # CUDA, the 0.75B shape, batch 8 x 1024
    python benchmarks/profile_gpu.py --device cpu --shape tiny --seq-len 64 --out /tmp/profile.json
    python benchmarks/profile_gpu.py --bounds-of benchmarks/results/profile_gpu.json --out /tmp/bounds.json
"""

import argparse
import json
import os
import time
from collections.abc import Callable

import torch
from bench_gpu import VOCAB, build, config_kwargs, free, save, sync, to_host, token_ids
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from stem_hf import StemConfig
from stem_hf.cli_args import positive_int
from stem_hf.offload import StemOffloadEngine
from stem_hf.training import RowSparseAdamW, param_groups, use_sparse_table_grads

VARIANTS = {  # name: (what, STEM spec or None for dense, where the tables are)
    "prefill_dense": ("prefill", None, "resident"),
    "prefill_stem_full_resident": ("prefill", "full", "resident"),
    "prefill_stem_1_2_host": ("prefill", "1/2", "host"),
    "prefill_stem_1_2_engine": ("prefill", "1/2", "engine"),
    "train_dense": ("train", None, "resident"),
    "train_stem_1_2_resident": ("train", "1/2", "resident"),
    "train_stem_1_2_host": ("train", "1/2", "host"),
    "decode_b64_dense": ("decode", None, "resident"),
    "decode_b64_stem_1_2_resident": ("decode", "1/2", "resident"),
    "decode_b64_stem_1_2_host": ("decode", "1/2", "host"),
}
DECODE_BATCH, PROMPT_LEN, NEW_TOKENS = 64, 256, 16
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def variants(text: str) -> list[str]:
    """The type of `--only`: variants among `VARIANTS`, comma-separated (empty: all)."""
    chosen = list(filter(None, text.split(",")))
    if any(name not in VARIANTS for name in chosen):
        raise argparse.ArgumentTypeError(f"must be among {', '.join(VARIANTS)}, comma-separated, not {text!r}")
    return chosen or list(VARIANTS)


def profiled(step: Callable[[], object], device: torch.device, top: int) -> dict:
    """One profiled `step` after two warm-ups: its wall time, the device's kernel time and the operators' own host
    time, summed, and the operators that take the most of each (on a CPU, device time is host time)."""
    for _ in range(2):
        step()
    sync(device)
    on_device = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        sync(device)
        wall = time.perf_counter() - start
    ops = [e for e in prof.key_averages() if e.device_type == DeviceType.CPU]
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]

    def device_us(e) -> float:
        return e.self_device_time_total if on_device else e.self_cpu_time_total

    def rows(key) -> list[dict]:
        return [
            {
                "op": e.key,
                "calls": e.count,
                "device_ms": round(device_us(e) / 1e3, 3),
                "host_ms": round(e.self_cpu_time_total / 1e3, 3),
            }  # fmt: skip
            for e in sorted(ops, key=key, reverse=True)[:top]
        ]

    return {
        "wall_ms": round(wall * 1e3, 3),  # under the profiler, which adds host time
        "device_ms": round(sum(device_us(e) for e in (kernels if on_device else ops)) / 1e3, 3),
        "host_ms": round(sum(e.self_cpu_time_total for e in ops) / 1e3, 3),
        "matmul_device_ms": round(sum(device_us(e) for e in ops if e.key in MATMULS) / 1e3, 3),
        "top_device": rows(device_us),
        "top_host": rows(lambda e: e.self_cpu_time_total),
    }


def matmul_ms(variant: dict) -> float:
    """A variant's matrix products' device time: summed over every operator, or (a profile saved before that sum was)
    over its top operators."""
    if "matmul_device_ms" in variant:
        return variant["matmul_device_ms"]
    return sum(row["device_ms"] for row in variant["top_device"] if row["op"] in MATMULS)


def bounds(report: dict) -> dict:
    """Per STEM variant profiled beside its dense one (same what, resident tables), in device time (the kernels', which
    the profiler's host cost leaves out): the matrix products STEM saves, per STEM layer, and their share of dense's
    time; what STEM adds besides (its time minus dense's, plus what it saved); and the speedup over dense were the
    saved matrix products STEM's only change, dense / (dense - saved), for its STEM layers and, scaled by layers, for
    STEM-full. FLOPs predict more where the matrix products are less than all of the time."""
    shape, out = report["args"]["shape"], {}
    for name, (what, spec, tables) in VARIANTS.items():
        dense = next((k for k, v in VARIANTS.items() if v == (what, None, "resident")), None)
        if spec is None or tables != "resident" or name not in report or dense not in report:
            continue
        layers = {s: len(StemConfig(**config_kwargs(shape), stem_layers=s).stem_layers) for s in (spec, "full")}
        total, saved = report[dense]["device_ms"], matmul_ms(report[dense]) - matmul_ms(report[name])
        per_layer = saved / layers[spec]
        out[name] = {
            "dense": dense,
            "stem_layers": layers[spec],
            "matmul_saved_ms": round(saved, 3),
            "matmul_saved_per_stem_layer_ms": round(per_layer, 3),
            "matmul_share_of_dense": round(matmul_ms(report[dense]) / total, 3),
            "stem_adds_ms": round(report[name]["device_ms"] - total + saved, 3),
            "speedup_matmuls_alone": round(total / (total - saved), 3),
            "speedup_matmuls_alone_full": round(total / (total - per_layer * layers["full"]), 3),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="0.75b", choices=sorted(VOCAB))
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--seq-len", type=positive_int, default=1024)
    parser.add_argument("--top", type=positive_int, default=30)
    parser.add_argument("--only", type=variants, default="", help="comma-separated variants (default: all): "
                        + ", ".join(VARIANTS))  # fmt: skip
    parser.add_argument("--out", default="benchmarks/results/profile_gpu.json")
    parser.add_argument("--bounds-of", help="a saved profile: write its `bounds` to --out, profile nothing")
    args = parser.parse_args()
    if args.bounds_of:
        if os.path.abspath(args.bounds_of) == os.path.abspath(args.out):
            parser.error("--out is the profile read: give another path")
        with open(args.bounds_of) as f:
            profile_report = json.load(f)
        result = {"profile": args.bounds_of, "bounds": bounds(profile_report)}
        save(result, args.out)
        print(json.dumps(result, indent=2))
        return
    device = torch.device(args.device)
    only = set(args.only)
    ids = token_ids("uniform", (args.batch_size, args.seq_len), VOCAB[args.shape], device)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "args": vars(args),
              "torch": torch.__version__, "ids": "uniform"}  # fmt: skip
    prompt = token_ids("zipf", (DECODE_BATCH, PROMPT_LEN), VOCAB[args.shape], device, seed=DECODE_BATCH)
    for name, (what, spec, tables) in VARIANTS.items():
        if name not in only or (tables == "host" and device.type == "cpu"):  # on a CPU, host is resident
            continue
        model = build(args.shape, spec, device)
        engine = None
        if what == "train":
            model.train()
            if spec is not None:
                use_sparse_table_grads(model)  # StemTrainer's default: row gradients, a row-sparse update
        if tables != "resident":
            to_host(model)
        if tables == "engine":
            engine = StemOffloadEngine(model, device=device).attach()
        if what == "prefill":

            def step(model=model):
                with torch.inference_mode():
                    model(ids)

        elif what == "decode":
            greedy = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)

            def step(model=model, greedy=greedy):
                model.generate(prompt, attention_mask=torch.ones_like(prompt), **greedy)

        else:
            optimizer = RowSparseAdamW(param_groups(model, lr=1e-5, row_sparse_tables=spec is not None))

            def step(model=model, optimizer=optimizer):
                optimizer.zero_grad(set_to_none=True)
                model(ids, labels=ids).loss.backward()
                optimizer.step()

        report[name] = profiled(step, device, args.top)
        if engine is not None:
            engine.detach()
        del model, step, engine
        optimizer = None  # a train variant's state goes with its model, before the next variant is built
        free()
        save(report, args.out)
    report["bounds"] = bounds(report)
    save(report, args.out)
    summary = {k: {m: v[m] for m in ("wall_ms", "device_ms", "host_ms")} for k, v in report.items() if k in VARIANTS}
    print(json.dumps({**summary, "bounds": report["bounds"]}, indent=2))


if __name__ == "__main__":
    main()
