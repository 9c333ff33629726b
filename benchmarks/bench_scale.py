"""Conversion and offloaded serving past host memory: peak memory of a streamed conversion against its table bytes,
the mapped offload store's memory and gather speed, and decode speed with tables larger than RAM.

Usage: python benchmarks/bench_scale.py [--cases small large] [--work runs/bench_scale] [--keep]
       python benchmarks/bench_scale.py --quick   # a tiny synthetic model, every step, ~1 min (the test runs it)

Cases (each step runs in a fresh interpreter that samples its own /proc/self/status every 20 ms):
- small: the embedded SmolLM2-135M (GGUF), `--init projected --stem-layers full --refit none` (4.4 GB of bf16 tables),
  converted streamed and in memory; then the offload store, the engine's host memory with a store built in memory
  against the mapped one, gathers and decode.
- large: a synthetic Llama of the Llama-3 vocabulary (128,256 tokens; hidden 1024, FFN 4096, 28 layers, 27 of them
  STEM with "full"; random weights, seed 0, saved in bf16), converted the same way: 28.4 GB (26.4 GiB) of tables, more
  than this machine's 24 GiB. The in-memory conversion and store cannot run here: only the refusal of the latter is
  recorded.

Measured per case: conversion peak RSS (anonymous, and total with mapped file pages) against table bytes; the store's
write; the serving process's anonymous RSS growth against table bytes with the mapped store (and with the in-memory
store where it fits); cold gathers (page cache dropped with posix_fadvise DONTNEED) with the read hints, with
random-access advice alone, with no advice at all, and from the per-layer tables, against two rates of the disk
measured in the same run: sequential (one synchronous reader, and the range advised WILLNEED first so that many
requests are in flight) and one token's rows at random offsets, 16 reads in flight; warm gathers against a memcpy of
the same bytes; decode tokens/s cold with the model's own mapped tables and with the mapped store. Disk: the large
case needs ~60 GB under --work (source 1.1 GB, checkpoint 30.2 GB, store 28.4 GB); all of it is removed at the end
unless --keep (after a killed run: rm -rf runs/bench_scale). Wall time on 2 cores: 15 to 20 min (large 10 to 13).
Results: benchmarks/results/bench_scale.json (--quick: bench_scale_quick.json).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
LARGE_SHAPE = dict(
    vocab_size=128256, hidden_size=1024, intermediate_size=4096, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=128000,
    eos_token_id=128001,
)  # fmt: skip
QUICK_SHAPE = dict(
    vocab_size=8192, hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
GIB = 2**30


class Peaks:
    """Samples this process's RssAnon / RssFile / VmRSS every `every` seconds; `peaks` holds the highest of each."""

    def __init__(self, every: float = 0.02):
        self.every, self.peaks, self._stop = every, {}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def status() -> dict:
        with open("/proc/self/status") as f:
            rows = [line.split(":", 1) for line in f if line.startswith(("RssAnon", "RssFile", "VmRSS", "VmHWM"))]
        return {k: int(v.split()[0]) * 1024 for k, v in rows}

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, value in self.status().items():
                self.peaks[key] = max(self.peaks.get(key, 0), value)
            time.sleep(self.every)

    def __enter__(self) -> "Peaks":
        self.start = self.status()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for key, value in self.status().items():
            self.peaks[key] = max(self.peaks.get(key, 0), value)


def evict(*paths: str) -> None:
    """Drops the files' clean pages from the page cache, so the next read comes from disk."""
    for path in paths:
        files = [os.path.join(path, n) for n in os.listdir(path)] if os.path.isdir(path) else [path]
        for name in files:
            if os.path.isfile(name):
                fd = os.open(name, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)


def _warm_imports() -> None:
    """A first forward maps torch's own code and allocator pools: done on a tiny model, so growth after it is the
    measured model's."""
    from stem_hf import StemConfig, StemForCausalLM

    tiny = StemConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    with torch.inference_mode():
        StemForCausalLM(tiny).generate(torch.randint(0, 64, (1, 8)), max_new_tokens=2, do_sample=False)


def table_bytes(folder: str) -> int:
    from stem_hf.checkpoint_stem import TABLES_NAME, read_safetensors_header

    prefix = TABLES_NAME.removesuffix(".safetensors")
    total = 0
    for name in os.listdir(folder):
        if name.startswith(prefix):
            header = read_safetensors_header(os.path.join(folder, name))
            total += sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values())
    return total


# Steps, each in its own interpreter -----------------------------------------------------------------------------


def step_source(out: str, shape: dict) -> dict:
    """A random dense Llama of `shape`, seed 0, saved in bf16 as a release would be."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    start = time.perf_counter()
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16)
    model.save_pretrained(out)
    return {"params": model.num_parameters(), "seconds": time.perf_counter() - start}


def step_convert(source: str, out: str, stream: bool) -> dict:
    from stem_hf.conversion import convert

    torch.set_flush_denormal(True)
    with Peaks() as peaks:
        start = time.perf_counter()
        convert(source, out, stem_layers="full", init="projected", refit="none", stream=stream)
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak": peaks.peaks, "start": peaks.start, "table_bytes": table_bytes(out)}


def step_store(checkpoint: str) -> dict:
    from stem_hf.offload import write_offload_store

    with Peaks() as peaks:
        start = time.perf_counter()
        path = write_offload_store(checkpoint)
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak": peaks.peaks, "store_bytes": os.path.getsize(path)}


def _decode(model, prompt: torch.Tensor, tokens: int) -> tuple[list[int], float, float]:
    """Greedy decode with the KV cache: (generated ids, prefill seconds, decode tokens/s)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        start = time.perf_counter()
        logits = model(prompt, cache=cache, use_cache=True, logits_to_keep=1).logits
        prefill = time.perf_counter() - start
        ids = [int(logits[0, -1].argmax())]
        start = time.perf_counter()
        for _ in range(tokens - 1):
            step = torch.tensor([[ids[-1]]])
            ids.append(int(model(step, cache=cache, use_cache=True).logits[0, -1].argmax()))
        decode = (tokens - 1) / (time.perf_counter() - start)
    return ids, prefill, decode


def step_serve(checkpoint: str, mode: str, tokens: int, prompt_len: int) -> dict:
    """Loads the checkpoint (tables memory-mapped), then serves a cold greedy decode with the model's own tables
    (`mode` "tables"), the mapped store ("mapped") or a store built in memory ("memory"); reports anonymous RSS
    growth over the load and the engine, and decode speed. `generate()` checks the same ids come out."""
    from stem_hf import StemForCausalLM
    from stem_hf.offload import STORE_NAME, StemOffloadEngine

    torch.set_num_threads(os.cpu_count())
    _warm_imports()
    evict(checkpoint)
    base = Peaks.status()
    model = StemForCausalLM.from_pretrained(checkpoint).eval()
    loaded = Peaks.status()
    engine = None
    if mode != "tables":
        store = os.path.join(checkpoint, STORE_NAME) if mode == "mapped" else None
        try:
            engine = StemOffloadEngine(model, store=store).attach()
        except MemoryError as error:  # a store in memory larger than memory: refused before it is built
            return {"mode": mode, "refused": str(error)}
    ready = Peaks.status()
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    ids, prefill, decode = _decode(model, prompt, tokens)
    with torch.inference_mode():
        generated = model.generate(prompt, max_new_tokens=4, do_sample=False)[0, prompt_len:].tolist()
    after = Peaks.status()
    if engine is not None:
        engine.detach()
    return {
        "mode": mode,
        "table_bytes": table_bytes(checkpoint),
        "anon_growth_load": loaded["RssAnon"] - base["RssAnon"],
        "anon_growth_engine": ready["RssAnon"] - loaded["RssAnon"],
        "anon_growth_total": after["RssAnon"] - base["RssAnon"],
        "rss_file_after": after["RssFile"],
        "prefill_s": prefill,
        "prompt_tokens": prompt_len,
        "decode_tokens_per_s": decode,
        "ids": ids,
        "generate_matches_decode": generated == ids[:4],
    }


def _seconds(fn, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _sequential_read(path: str, offset: int, nbytes: int, ahead: bool) -> float:
    """GB/s of reading `nbytes` of `path` from `offset` after dropping it from the page cache, in 16 MB reads: one
    synchronous reader (`cat`'s rate), or with the whole range first advised WILLNEED, so the kernel keeps many
    requests in flight, as the hinted gathers do."""
    evict(path)
    fd = os.open(path, os.O_RDONLY)
    start, done = time.perf_counter(), 0
    if ahead:
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_WILLNEED)
    while done < nbytes:
        chunk = os.pread(fd, min(16 << 20, nbytes - done), offset + done)
        if not chunk:
            break
        done += len(chunk)
    seconds = time.perf_counter() - start
    os.close(fd)
    return done / seconds / 1e9


def step_gather(checkpoint: str, tokens: int, read_bytes: int, repeats: int = 3) -> dict:
    """Gathers of `tokens` distinct random tokens' rows for all layers: from the mapped store cold (with the read
    hints, with random-access advice alone, with no advice) and warm, from the per-layer tables cold; against a memcpy
    of the same bytes, the disk's sequential read rate over `read_bytes` of the store file, and its rate for reads of
    one token's rows at random offsets, 16 in flight (preads into the same buffer). Each cold run draws fresh tokens
    after dropping the page cache; the cold store runs and the random reads take turns, `repeats` times, and report
    their median (every run is kept too: the disk's rate moves from run to run)."""
    from stem_hf.mapped import map_safetensors
    from stem_hf.offload import STORE_NAME, StemMappedTables

    torch.set_num_threads(os.cpu_count())
    path = os.path.join(checkpoint, STORE_NAME)
    hinted, plain = StemMappedTables(path), StemMappedTables(path, will_need=False)
    unadvised = map_safetensors(path)["rows"]  # the kernel's default read-ahead, no hint at all
    vocab, row = hinted.vocab_size, hinted.row_bytes()
    generator = torch.Generator().manual_seed(2)

    def fresh() -> torch.Tensor:
        return torch.randperm(vocab, generator=generator)[:tokens].sort().values

    out = torch.empty((tokens, *hinted.data.shape[1:]), dtype=hinted.data.dtype)
    buffer = memoryview(out.view(-1).view(torch.uint8).numpy())
    result = {"tokens": tokens, "row_bytes": row, "gathered_bytes": tokens * row}
    offset = hinted.offset
    result["disk_sequential_read_GBps"] = _sequential_read(path, offset, read_bytes, ahead=False)
    result["disk_sequential_read_ahead_GBps"] = _sequential_read(path, offset, read_bytes, ahead=True)
    fd = os.open(path, os.O_RDONLY)

    def random_rows(ids: torch.Tensor) -> None:
        def read(k: int) -> None:
            os.preadv(fd, [buffer[k * row : (k + 1) * row]], offset + int(ids[k]) * row)

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(read, range(len(ids))))

    cold = {
        "disk_random_rows": random_rows,
        "cold_hinted": lambda ids: hinted.gather(ids, out),
        "cold_plain": lambda ids: plain.gather(ids, out),
        "cold_no_advice": lambda ids: torch.index_select(unadvised, 0, ids, out=out),
    }
    runs = {name: [] for name in cold}
    for _ in range(repeats):
        for name, gather in cold.items():
            ids = fresh()
            evict(path)
            runs[name].append(tokens * row / _seconds(lambda: gather(ids)) / 1e9)  # noqa: B023
    os.close(fd)
    for name, rates in runs.items():
        result[f"{name}_GBps"] = sorted(rates)[len(rates) // 2]
        result[f"{name}_GBps_runs"] = [round(r, 3) for r in rates]
    ids = fresh()
    hinted.gather(ids, out)  # pages in
    result["warm_GBps"] = tokens * row / _seconds(lambda: hinted.gather(ids, out), repeat=5) / 1e9
    source = torch.empty_like(out).copy_(out)
    result["memcpy_GBps"] = tokens * row / _seconds(lambda: out.copy_(source), repeat=5) / 1e9
    tables = {}
    for name in os.listdir(checkpoint):
        if name.startswith("stem-tables"):
            tables.update(map_safetensors(os.path.join(checkpoint, name)))
    layered = [tables[k] for k in sorted(tables)]
    ids = fresh()
    evict(checkpoint)
    per_layer = torch.empty((len(layered), tokens, layered[0].shape[1]), dtype=layered[0].dtype)

    def gather_layers() -> None:
        for i, table in enumerate(layered):
            torch.index_select(table, 0, ids, out=per_layer[i])

    result["cold_per_layer_tables_GBps"] = tokens * row / _seconds(gather_layers) / 1e9
    return result


STEPS = {"source": step_source, "convert": step_convert, "store": step_store, "serve": step_serve}
STEPS["gather"] = step_gather


def run_step(name: str, **kwargs) -> dict:
    """Runs step `name` in a fresh interpreter; returns what it printed last (JSON)."""
    child = [sys.executable, os.path.abspath(__file__), "--step", name, json.dumps(kwargs)]
    done = subprocess.run(child, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"step {name} failed (exit {done.returncode}): {done.stdout[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _gib(n: int) -> float:
    return round(n / GIB, 3)


def summarize_conversion(run: dict) -> dict:
    """Peaks of the converting process, whole and above what it held before `convert` (interpreter, torch,
    transformers: not the conversion's), against the bytes of the tables it wrote."""
    tables, peak, start = run["table_bytes"], run["peak"], run["start"]
    return {
        "seconds": round(run["seconds"], 1),
        "table_GiB": _gib(tables),
        "peak_anon_GiB": _gib(peak["RssAnon"]),
        "peak_total_GiB": _gib(peak["VmRSS"]),
        "peak_anon_above_start_GiB": _gib(peak["RssAnon"] - start["RssAnon"]),
        "peak_total_above_start_GiB": _gib(peak["VmRSS"] - start["VmRSS"]),
        "peak_anon_over_tables": round(peak["RssAnon"] / tables, 4),
        "peak_total_over_tables": round(peak["VmRSS"] / tables, 4),
    }


def run_case(name: str, source: str, work: str, in_memory: bool, tokens: int, prompt_len: int, gather: int) -> dict:
    case = {}
    streamed = os.path.join(work, f"{name}-stem")
    case["convert_streamed"] = summarize_conversion(run_step("convert", source=source, out=streamed, stream=True))
    if in_memory:
        other = os.path.join(work, f"{name}-stem-in-memory")
        case["convert_in_memory"] = summarize_conversion(run_step("convert", source=source, out=other, stream=False))
        shutil.rmtree(other)
    store = run_step("store", checkpoint=streamed)
    case["store"] = {
        "seconds": round(store["seconds"], 1),
        "store_GiB": _gib(store["store_bytes"]),
        "peak_anon_GiB": _gib(store["peak"]["RssAnon"]),
    }
    serving = {}
    for mode in ("tables", "mapped", "memory"):
        run = run_step("serve", checkpoint=streamed, mode=mode, tokens=tokens, prompt_len=prompt_len)
        serving[mode] = run
    reference = serving["tables"]["ids"]
    refused = {mode: run for mode, run in serving.items() if "refused" in run}
    case["serve"] = {mode: run for mode, run in refused.items()}
    case["serve"] |= {
        mode: {
            "anon_growth_GiB": _gib(run["anon_growth_total"]),
            "anon_growth_engine_GiB": _gib(run["anon_growth_engine"]),
            "anon_growth_over_tables": round(run["anon_growth_total"] / run["table_bytes"], 4),
            "prefill_s": round(run["prefill_s"], 2),
            "decode_tokens_per_s": round(run["decode_tokens_per_s"], 2),
            "same_ids_as_own_tables": run["ids"] == reference,
            "generate_matches_decode": run["generate_matches_decode"],
        }
        for mode, run in serving.items()
        if mode not in refused
    }
    case["serve_setup"] = {"prompt_tokens": prompt_len, "decoded_tokens": tokens, "cold": True}
    g = run_step("gather", checkpoint=streamed, tokens=gather, read_bytes=min(4 * GIB, store["store_bytes"]))
    case["gather"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in g.items()}
    case["gather"]["warm_over_memcpy"] = round(g["warm_GBps"] / g["memcpy_GBps"], 3)
    disk = max(g["disk_sequential_read_GBps"], g["disk_sequential_read_ahead_GBps"])  # the disk's best sequential rate
    for cold in ("hinted", "plain", "no_advice"):
        case["gather"][f"cold_{cold}_over_disk"] = round(g[f"cold_{cold}_GBps"] / disk, 3)
        case["gather"][f"cold_{cold}_over_random_rows"] = round(g[f"cold_{cold}_GBps"] / g["disk_random_rows_GBps"], 3)
    case["gather"]["cold_hinted_over_per_layer_tables"] = round(
        g["cold_hinted_GBps"] / g["cold_per_layer_tables_GBps"], 1
    )
    case["disk_GiB"] = _gib(sum(os.path.getsize(os.path.join(streamed, f)) for f in os.listdir(streamed)))
    return case


def plot(results: dict, path: str) -> None:
    """Two panels per case: host memory against the tables (conversion peaks, serving growth) and gather speeds
    against the disk and a memcpy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [name for name in ("small", "large", "quick") if name in results]
    fig, (memory, speed) = plt.subplots(1, 2, figsize=(13, 5.8))
    bars = [
        ("tables", lambda c: c["convert_streamed"]["table_GiB"]),
        ("convert, streamed", lambda c: c["convert_streamed"]["peak_anon_GiB"]),
        ("convert, in memory", lambda c: c.get("convert_in_memory", {}).get("peak_anon_GiB")),
        ("serve, own mapped tables", lambda c: c["serve"]["tables"].get("anon_growth_GiB")),
        ("serve, mapped store", lambda c: c["serve"]["mapped"].get("anon_growth_GiB")),
        ("serve, store in memory", lambda c: c["serve"]["memory"].get("anon_growth_GiB")),
    ]
    width = 0.8 / len(bars)
    for i, (label, value) in enumerate(bars):
        for j, name in enumerate(cases):
            v = value(results[name])
            x = j + (i - len(bars) / 2 + 0.5) * width
            if v is None:
                memory.text(x, 0.3, "not run" if label.startswith("convert") else "refused", rotation=90, ha="center",
                            fontsize=7, color="grey")  # fmt: skip
                continue
            memory.bar(x, v, width, color=f"C{i}", label=label if j == 0 else None)
            memory.text(x, v, f"{v:.2f}" if v < 10 else f"{v:.1f}", ha="center", va="bottom", fontsize=6)
    memory.set_xticks(range(len(cases)), [f"{n}: {results[n]['convert_streamed']['table_GiB']:.1f} GiB of tables"
                                          for n in cases])  # fmt: skip
    memory.axhline(results["machine"]["memory_GiB"], color="grey", linestyle=":", linewidth=1)
    memory.text(len(cases) - 0.55, results["machine"]["memory_GiB"], "host memory", ha="right", va="bottom",
                color="grey", fontsize=8)  # fmt: skip
    memory.set_ylabel("GiB (anonymous memory: conversion peak, serving growth)")
    memory.set_title("Host memory against the tables")
    memory.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)
    speeds = [
        (
            "disk, sequential (best)",
            lambda g: max(g["disk_sequential_read_GBps"], g["disk_sequential_read_ahead_GBps"]),
        ),
        ("disk, random rows (16 in flight)", lambda g: g.get("disk_random_rows_GBps")),
        ("cold, store, read hints", lambda g: g["cold_hinted_GBps"]),
        ("cold, store, random-access advice only", lambda g: g["cold_plain_GBps"]),
        ("cold, store, no advice", lambda g: g.get("cold_no_advice_GBps")),
        ("cold, per-layer tables", lambda g: g["cold_per_layer_tables_GBps"]),
        ("warm, store", lambda g: g["warm_GBps"]),
        ("memcpy", lambda g: g["memcpy_GBps"]),
    ]
    width = 0.8 / len(speeds)
    for i, (label, value) in enumerate(speeds):
        for j, name in enumerate(cases):
            v = value(results[name]["gather"])
            if v is None:
                continue
            x = j + (i - len(speeds) / 2 + 0.5) * width
            speed.bar(x, v, width, color=f"C{i}", label=label if j == 0 else None)
            speed.text(x, v, f"{v:.3g}", ha="center", va="bottom", fontsize=6)
    speed.set_yscale("log")
    speed.set_xticks(range(len(cases)), [f"{n}: {results[n]['gather']['tokens']} random tokens" for n in cases])
    speed.set_ylabel("GB/s")
    speed.set_title("Gathering every layer's rows of random tokens")
    speed.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)
    fig.suptitle(f"Past one host's memory ({results['machine']['cpus']} CPU cores, "
                 f"{results['machine']['memory_GiB']:.1f} GiB)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=["small", "large"], choices=["small", "large"])
    parser.add_argument("--work", default="runs/bench_scale", help="where sources and checkpoints go (~60 GB large)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints and stores under --work")
    parser.add_argument("--quick", action="store_true", help="a tiny synthetic model through every step")
    parser.add_argument(
        "--out", default=None, help="results JSON (default: benchmarks/results/bench_scale[_quick].json)"
    )
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the saved JSON, run nothing")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()  # a step's own arguments, as JSON, follow `--step`
    if rest and not args.step:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.step:
        print(json.dumps(STEPS[args.step](**json.loads(rest[0]))))
        return
    out = args.out or os.path.join(RESULTS, "bench_scale_quick.json" if args.quick else "bench_scale.json")
    if args.plot_only:
        with open(out) as f:
            plot(json.load(f), os.path.splitext(out)[0] + ".png")
        return
    os.makedirs(args.work, exist_ok=True)
    started = time.perf_counter()
    results = {
        "machine": {
            "cpus": os.cpu_count(),
            "memory_GiB": _gib(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")),
        }
    }
    cases = ["quick"] if args.quick else args.cases
    for name in cases:
        case_started = time.perf_counter()
        if name == "small":
            from stem_hf.assets import smollm2_gguf

            source = smollm2_gguf()
            results[name] = {"source": "SmolLM2-135M-Instruct (embedded GGUF)"}
            results[name].update(run_case(name, source, args.work, True, tokens=32, prompt_len=64, gather=2048))
        else:
            shape = QUICK_SHAPE if name == "quick" else LARGE_SHAPE
            source = os.path.join(args.work, f"{name}-source")
            made = run_step("source", out=source, shape=shape)
            results[name] = {"source": {"shape": shape, "params": made["params"], "seconds": round(made["seconds"], 1)}}
            tokens, gather = (8, 256) if name == "quick" else (16, 1024)
            results[name].update(run_case(name, source, args.work, name == "quick", tokens, 32, gather))
            if not args.keep:
                shutil.rmtree(source)
        if not args.keep:
            shutil.rmtree(os.path.join(args.work, f"{name}-stem"))
        # A run of some cases keeps the others' results: each case says when it ran and how long it took.
        results[name]["measured_on"] = time.strftime("%Y-%m-%d")
        results[name]["wall_seconds"] = round(time.perf_counter() - case_started, 1)
    results["wall_seconds"] = round(time.perf_counter() - started, 1)
    if os.path.exists(out) and not args.quick:  # a run of some cases keeps the others'
        with open(out) as f:
            results = {**json.load(f), **results}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".tmp", "w") as f:
        f.write(json.dumps(results, indent=2) + "\n")
    os.replace(out + ".tmp", out)  # whole or not at all
    plot(results, os.path.splitext(out)[0] + ".png")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
