"""What STEM, and serving its tables from host memory, costs a decoding step, where the step waits on the thread that
launches its kernels (eager decoding on a GPU: each of `bench_gpu.py`'s decode steps is mostly launches). Greedy
decode of `--new-tokens` after a `--prompt-len` Zipf prompt per batch, a dense Llama and STEM-1/2 of the same shape
with its tables four ways, timed in turn round by round (`bench_gpu.paired_decode`):

- `dense`: `LlamaForCausalLM`, the baseline (`resident_vs_dense`, `host_vs_dense`: its step time over theirs);
- `resident`: the tables on the device of the ids;
- `host`: the model's own host path as it serves a decoding step (at most `HOST_AT_ONCE_MAX_IDS` distinct ids, in
  inference: every table's rows gathered at once, by the forward's own thread, one copy);
- `host_pipelined`: the same path with every forward pipelined (`HOST_AT_ONCE_MAX_IDS` = 0: the worker thread
  fetches each layer's rows ahead of the layers), as every forward was served before;
- `engine`: `StemOffloadEngine` with a row cache of `--cache-tokens` tokens on the device (`engine_vs_host`: the
  plain host path's step time over the engine's), warm after the first run.

Per decoding step it also counts the operators the forward's own thread dispatches, its Python calls, and the gathers
each thread runs.
On a CPU the tables are routed through the host path with the ids on the CPU too, as the tests route them (what is
missing is the copy to an accelerator, a side-stream copy of the gathered rows); the default shape (`tiny`, 12 layers)
is small enough that a step is launch-bound, as on a GPU; one intra-op thread leaves this 2-core machine's second core
to the worker thread, as a GPU host's many cores do. On CUDA the tables go to host memory.

    python benchmarks/bench_host_decode.py --threads 1 --repeats 15   # bench_host_decode.json: 3 minutes here
    python benchmarks/bench_host_decode.py --device cuda --shape 0.75b --dtype bfloat16 \
        --out benchmarks/results/bench_host_decode_gpu.json
"""

import argparse
import sys
import threading
from contextlib import contextmanager
from functools import partial

import torch
from bench_gpu import SHAPES, VOCAB, config_kwargs, decode_once, paired_decode, save, token_ids
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from stem_hf import StemConfig, StemForCausalLM, modeling_stem, offload
from stem_hf.cli_args import positive_int, positive_ints
from stem_hf.compat_stem import CACHE_ARG
from stem_hf.offload import StemOffloadEngine


class Dispatched(TorchDispatchMode):
    """Counts the operators dispatched by the thread that enters it (dispatch modes are per thread)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def build(args, device: torch.device, dense: bool = False) -> StemForCausalLM | LlamaForCausalLM:
    """A random STEM-1/2 model of `--shape` with `--layers` layers, tables resident, in `--dtype`; or (`dense`) the
    Llama of the same shape."""
    torch.manual_seed(0)
    kwargs = {**config_kwargs(args.shape), "num_hidden_layers": args.layers}
    if dense:
        config = LlamaConfig(**kwargs)
    else:
        config = StemConfig(**kwargs, stem_layers="1/2", table_dtype=args.dtype)
        config.keep_tables_on_cpu = False
    with torch.device(device):
        model = (LlamaForCausalLM if dense else StemForCausalLM)(config)
    return model.to(getattr(torch, args.dtype)).eval()


@contextmanager
def tables(models: dict, way: str):
    """The model whose tables are served as `way` says, for the block: `dense` (no tables), `resident`, by the host path
    (`host`; `host_pipelined`, every forward fetched by the worker thread), or by the offload engine (`engine`). On a
    CPU one STEM model, routed through the host path with the ids on the CPU; on an accelerator a second model of the
    same weights whose tables are in host memory, which the engine serves too."""
    if way == "engine":
        with models["engine"].attach():
            yield models["engine"].model
        return
    model = models[way] if way in ("dense", "resident") else models["host"]
    saved = modeling_stem.HOST_AT_ONCE_MAX_IDS, modeling_stem.StemTableRows.host_served
    if way == "host_pipelined":
        modeling_stem.HOST_AT_ONCE_MAX_IDS = 0
    if way.startswith("host") and model.device.type == "cpu":
        modeling_stem.StemTableRows.host_served = lambda self, table: True
    try:
        yield model
    finally:
        modeling_stem.HOST_AT_ONCE_MAX_IDS, modeling_stem.StemTableRows.host_served = saved


def decode_with(models: dict, way: str, prompt: torch.Tensor, **timing) -> tuple[float, torch.Tensor]:
    with tables(models, way) as model:
        return decode_once(model, prompt, **timing)


@contextmanager
def gathers_by_thread():
    """Yields a dict that counts `gather_rows` calls of the host path and the engine by thread: the forward's own
    (`forward`), a worker's (`worker`)."""
    counts = {"forward": 0, "worker": 0}
    gather = modeling_stem.gather_rows
    assert offload.gather_rows is gather  # the engine's, by the name it imported
    forward_thread = threading.current_thread()

    def counted(*args, **kwargs):
        counts["forward" if threading.current_thread() is forward_thread else "worker"] += 1
        return gather(*args, **kwargs)

    modeling_stem.gather_rows = offload.gather_rows = counted
    try:
        yield counts
    finally:
        modeling_stem.gather_rows = offload.gather_rows = gather


@contextmanager
def python_calls():
    """Yields a dict whose `calls` counts the Python functions the calling thread enters in the block."""
    counts = {"calls": 0}

    def count(frame, event, arg) -> None:
        if event == "call":
            counts["calls"] += 1

    profiler = sys.getprofile()
    sys.setprofile(count)
    try:
        yield counts
    finally:
        sys.setprofile(profiler)


@torch.no_grad()
def one_step(models: dict, way: str, prompt: torch.Tensor) -> dict:
    """One decoding step after the prompt's prefill: the operators its thread dispatched, its Python calls (a second
    step, apart: the profile function slows the operators down) and the gathers per thread."""
    with tables(models, way) as model:
        out = model(prompt, use_cache=True)
        step = out.logits[:, -1:].argmax(-1)
        cache = getattr(out, CACHE_ARG)
        with gathers_by_thread() as gathers, Dispatched() as dispatched:
            model(step, **{CACHE_ARG: cache}, use_cache=True)
        with python_calls() as python:
            model(step, **{CACHE_ARG: cache}, use_cache=True)
    return {
        "ops": dispatched.count,
        "python_calls": python["calls"],
        "gathers_forward_thread": gathers["forward"],
        "gathers_worker": gathers["worker"],
    }


WAYS = ("dense", "resident", "host", "host_pipelined", "engine")


def run(args, device: torch.device, report: dict) -> None:
    """Fills `report` batch by batch, saving it after each (`complete` once every batch is in)."""
    models = {"dense": build(args, device, dense=True), "resident": build(args, device)}
    models["host"] = models["resident"]
    if device.type != "cpu":
        models["host"] = build(args, device)
        models["host"].config.keep_tables_on_cpu = True
        models["host"].model.stem_tables.to("cpu")
    models["engine"] = StemOffloadEngine(models["host"], cache_tokens=args.cache_tokens, device=device)
    timing = dict(new=args.new_tokens, device=device)
    for batch in tqdm(args.batches, desc="host decode"):
        prompt = token_ids("zipf", (batch, args.prompt_len), VOCAB[args.shape], device, seed=batch)
        runs = paired_decode({way: partial(decode_with, models, way, **timing) for way in WAYS}, prompt, args.repeats)
        row = {"distinct_ids_per_step_at_most": batch}
        for way in WAYS:
            step_s, tokens, repeatable = runs[way]
            row[way] = {"step_ms": round(step_s * 1e3, 3), **one_step(models, way, prompt)}
            if way != "dense":  # another model's tokens
                row[way]["same_tokens_as_resident"] = bool(torch.equal(tokens, runs["resident"][1]))
        dense, resident, host, pipelined, engine = (runs[way][0] for way in WAYS)
        row["resident_vs_dense"] = round(dense / resident, 3)
        row["host_vs_dense"] = round(dense / host, 3)
        row["host_vs_resident"] = round(resident / host, 3)
        row["host_pipelined_vs_resident"] = round(resident / pipelined, 3)
        row["host_over_host_pipelined"] = round(pipelined / host, 3)
        row["engine_vs_resident"] = round(resident / engine, 3)
        row["engine_vs_host"] = round(host / engine, 3)
        report[f"batch_{batch}"] = row
        save({**report, "complete": False}, args.out)  # what a run stopped midway measured stays
    report["complete"] = True
    save(report, args.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--layers", type=positive_int, default=12, help="the 0.75B shape's count")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--batches", type=positive_ints, default=[1, 16, 64, 128], help="comma-separated")
    parser.add_argument("--prompt-len", type=positive_int, default=64)
    parser.add_argument("--new-tokens", type=positive_int, default=32)
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--cache-tokens", type=positive_int, default=4096, help="the engine's row cache")
    parser.add_argument("--threads", type=positive_int, help="torch's intra-op threads (default: torch's)")
    parser.add_argument("--out", default="benchmarks/results/bench_host_decode.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {
        "torch": torch.__version__,
        "device": str(device),
        "shape": args.shape,
        "layers": args.layers,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "host_at_once_max_ids": modeling_stem.HOST_AT_ONCE_MAX_IDS,
        "engine_cache_tokens": args.cache_tokens,
    }
    run(args, device, report)
    print(report)


if __name__ == "__main__":
    main()
