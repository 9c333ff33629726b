"""The GPU check behind `benchmarks/gpu_check.sh`: the CUDA paths' correctness tests, then the GPU benchmarks, as one
JSON object on stdout (and in `benchmarks/results/gpu_check.json`).

    bash benchmarks/gpu_check.sh            # or: .venv/bin/python benchmarks/gpu_check.py [--budget-s 570]

Without a CUDA device it prints `{"status": "skipped", ...}` and exits 0: nothing ran, and it says so.

With one:
1. tests: `pytest tests/test_gpu.py` (the CUDA paths against a CPU reference: host tables with the dense part on the
   GPU, offload streams and events, pinned staging, the background gather, device-map loads, bf16 healing) and the CPU
   suites of the same components (`test_offload.py`, `test_placement.py`, `test_heal.py`), which must still pass on a
   CUDA build of torch. Counts come from pytest's JUnit XML.
2. benchmarks on a random STEM model built here (no download: 8 layers, hidden 512, d_ff 2048, vocab 32000, STEM layers
   1/2, bf16): greedy decode and prefill speed with the tables in host memory (the model's own gather), served by the
   offload engine (no cache, a 4096-token row cache, int8), and resident on the GPU; device memory (allocated after
   placement and peak while decoding) of each; copy/compute overlap of the engine's side stream (host-to-device copy
   alone, the engine's gather + copy alone, a GEMM workload alone, and both together); and a chunked prefill planned
   ahead (`engine.plan`, the background gather thread) against the same prefill served forward by forward.
3. `benchmarks/bench_lookup_kernel.py` in a subprocess (at most 100 s): the fused lookup's kernels at one layer of 8192
   tokens by compile mode, and the table gradient's sum into distinct rows four ways.
4. `benchmarks/bench_gpu.py` in a subprocess, with what is left of the budget: STEM against a dense Llama at a 0.75B
   shape (prefill, train step with its optimizer, decode; resident, host and engine tables), each ratio beside its
   FLOP prediction (`docs/gpu.md`).
5. `benchmarks/bench_host_decode.py` in a subprocess, if time is left: greedy decoding steps of the 0.75B shape, a
   dense Llama and STEM-1/2 with resident tables, host tables served as decoding steps are (every table's rows at
   once, by the forward's thread), host tables with every forward pipelined (the worker thread fetching each layer's
   rows ahead) and the offload engine with a row cache, in turn.
6. `benchmarks/profile_gpu.py` in a subprocess, if time is left: prefill and a train step of dense and STEM profiled
   beside each other (what STEM saves in matrix products, `bounds`), and the host-table and engine prefills.
7. `benchmarks/bench_host_gather.py` in a subprocess, if time is left: the host side of the engine's gather at the
   0.75B shape, `index_select` against `gather_rows` and the per-layer gathers, on one thread and on every core of the
   GPU's host.

Every part is time-boxed (`--budget-s`, default 570 s: the whole check stays under 10 minutes); a part that would not
fit is reported as skipped, and a watchdog prints what was measured so far if the budget runs out anyway. `parts` in
the JSON says, for each part, whether it ran. Exit status: 0 when everything that ran passed, 1 when a test failed
(or pytest could not run), 2 when a benchmark raised, 3 when the watchdog stopped the check.
"""

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_FILES = ["tests/test_gpu.py", "tests/test_offload.py", "tests/test_placement.py", "tests/test_heal.py"]
# The benchmark model: tables (4 x 32000 x 2048 bf16 = 524 MB) outweigh the dense part (about 60M parameters).
BENCH_CONFIG = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    stem_layers="1/2",
    table_dtype="bfloat16",
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
MIB = 2**20


def log(message: str) -> None:
    print(f"gpu_check: {message}", file=sys.stderr, flush=True)


def versions() -> dict:
    out = {"python": sys.version.split()[0], "interpreter": sys.executable, "torch": torch.__version__}
    out["cuda_build"] = torch.version.cuda
    for name in ("transformers", "accelerate", "safetensors"):
        try:
            out[name] = __import__(name).__version__
        except Exception as error:  # noqa: BLE001 - reported, not fatal: the tests will say what breaks
            out[name] = f"not importable: {error!r}"
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Tests


def repo_env() -> dict:
    """This environment with the repository first on PYTHONPATH: subprocesses import this checkout's stem_hf."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}


def run_tests(files: list[str], timeout_s: float, log_path: str, state: dict) -> dict:
    """Runs pytest on `files` in a subprocess; returns counts from its JUnit XML and the failures' names."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = os.path.join(tmp, "junit.xml")
        command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}"]
        command += files
        env = repo_env()
        start = time.perf_counter()
        with open(log_path, "w") as out:
            process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
            state["pytest"] = process
            try:
                returncode = process.wait(timeout=max(timeout_s, 1))
                timed_out = False
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                returncode, timed_out = None, True
            finally:
                state["pytest"] = None
        result = {
            "files": files,
            "command": " ".join(command[2:]),
            "returncode": returncode,
            "timed_out": timed_out,
            "wall_s": round(time.perf_counter() - start, 1),
            "log": os.path.relpath(log_path, REPO),
        }
        if not os.path.exists(junit):
            result["error"] = "pytest wrote no JUnit XML: " + _tail(log_path)
            return result
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        failed, skipped = [], []
        root = ET.parse(junit).getroot()
        suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
        for suite in suites:
            for key in counts:
                counts[key] += int(suite.get(key, 0))
            for case in suite.iter("testcase"):
                name = f"{case.get('classname', '')}::{case.get('name', '')}"
                for kind in ("failure", "error"):
                    node = case.find(kind)
                    if node is not None:
                        message = (node.get("message") or node.text or "").strip().splitlines()
                        failed.append({"test": name, "kind": kind, "message": " ".join(message[:3])[:400]})
                node = case.find("skipped")
                if node is not None:
                    skipped.append({"test": name, "reason": (node.get("message") or "")[:200]})
        counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        result.update(counts, failed=failed)
        # On a GPU no CUDA test should skip: one that did is listed (CPU-only suites skip nothing either).
        result["skipped_tests"] = skipped
        return result


def _tail(path: str, chars: int = 1500) -> str:
    try:
        with open(path) as f:
            return f.read()[-chars:]
    except OSError:
        return ""


# ----------------------------------------------------------------------------------------------------------------------
# Benchmarks


def sync() -> None:
    torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:
    """Median wall seconds of `fn` after one warm-up, the whole device synchronized before and after each run (the
    side stream's copies included)."""
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def allocated() -> int:
    gc.collect()  # an engine just detached, or a model's cycles, free their device tensors now
    sync()
    return torch.cuda.memory_allocated()


def build_model(device: torch.device):
    from stem_hf import StemConfig, StemForCausalLM

    torch.manual_seed(0)
    config = StemConfig(**BENCH_CONFIG)
    model = StemForCausalLM(config).eval().to(torch.bfloat16)  # tables are bf16 already (table_dtype)
    base = allocated()
    model.to(device)  # keep_tables_on_cpu: the dense part moves, the tables stay in host memory
    tables = model.model.stem_tables
    if any(t.weight.device.type != "cpu" for t in tables.values()):
        raise RuntimeError("model.to(cuda) moved the tables: keep_tables_on_cpu did not hold")
    if model.model.embed_tokens.weight.device.type != "cuda":
        raise RuntimeError("model.to(cuda) left the dense part on the host")
    info = {
        "config": {k: v for k, v in BENCH_CONFIG.items() if k != "rope_parameters"},
        "stem_layers": config.stem_layers,
        "table_bytes": sum(t.weight.numel() * t.weight.element_size() for t in tables.values()),
        "dense_bytes": sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "stem_tables" not in n),
    }
    return model, base, info


def generate(model, prompt: torch.Tensor, new_tokens: int, **kwargs) -> torch.Tensor:
    return model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        **kwargs,
    )


class StepClock:
    """A logits processor that stamps the time each generation step's logits are ready (the device synchronized):
    the first stamp ends the prefill, the others are decode steps. Per-step stamps make decode speed one measurement,
    not a difference of two noisy ones."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        sync()
        self.times.append(time.perf_counter())
        return scores


def decode_speed(model, prompts: dict[int, torch.Tensor], new_tokens: int, repeats: int, base: int) -> dict:
    """Prefill and greedy decode speed per batch size (medians over `repeats` generations after a warm-up), device
    memory allocated before (static) and at the peak while generating, and the generated tokens."""
    from transformers import LogitsProcessorList

    out, tokens = {"static_mib": (allocated() - base) / MIB}, {}
    torch.cuda.reset_peak_memory_stats()
    for batch, prompt in prompts.items():
        prefill, decode = [], []
        for run in range(repeats + 1):  # run 0 warms up
            clock = StepClock()
            sync()
            start = time.perf_counter()
            generated = generate(model, prompt, new_tokens, logits_processor=LogitsProcessorList([clock]))
            if len(clock.times) != new_tokens:
                raise RuntimeError(f"{len(clock.times)} generation steps timed, {new_tokens} expected")
            if run:
                prefill.append(clock.times[0] - start)
                decode.append((clock.times[-1] - clock.times[0]) / (new_tokens - 1))
        step = statistics.median(decode)
        out[f"batch_{batch}"] = {
            "prefill_tokens_per_s": prompt.numel() / statistics.median(prefill),
            "decode_tokens_per_s": batch / step,
            "decode_step_ms": step * 1e3,
        }
        tokens[batch] = generated.cpu()
    out["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / MIB
    return out, tokens


def overlap(engine, repeats: int, tokens: int = 8192, gemm: int = 8192) -> dict:
    """How much of the engine's row fetch (host gather into pinned staging, copy on the side stream) hides behind
    compute on the main stream. Compute is a run of bf16 GEMMs sized to last about as long as what it is set against;
    `overlap` = (alone + alone - together) / the shorter of the two: 1 is full overlap, 0 none."""
    store, device = engine.store, engine.device
    n = min(tokens, store.vocab_size)
    ids = torch.randperm(store.vocab_size, generator=torch.Generator().manual_seed(0))[:n].sort().values
    staging = torch.empty((n, *store.data.shape[1:]), dtype=store.data.dtype, pin_memory=True)
    store.gather(ids, staging)
    target = torch.empty(staging.shape, dtype=staging.dtype, device=device)
    nbytes = staging.numel() * staging.element_size()
    a = torch.randn(gemm, gemm, device=device, dtype=torch.bfloat16)
    b = torch.randn(gemm, gemm, device=device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    if engine.stream is None or engine.stream == torch.cuda.current_stream(device):
        raise RuntimeError("the engine has no side stream of its own")

    def copy():
        with torch.cuda.stream(engine.stream):
            target.copy_(staging, non_blocking=True)

    def gather():
        store.gather(ids, staging)

    def fetch():
        engine._fetch(ids)  # what each forward does: gather into the engine's pinned staging, copy on the side stream

    def gemms(k: int):
        for _ in range(k):
            torch.mm(a, b, out=c)

    fetch()  # the engine's two staging buffers, grown (pinned: slow to allocate) before anything is timed
    fetch()
    copy_s, gather_s, fetch_s = timed(copy, repeats), timed(gather, repeats), timed(fetch, repeats)
    gemm_s = timed(lambda: gemms(1), repeats)
    result = {
        "tokens": n,
        "bytes": nbytes,
        "h2d_pinned_gb_per_s": nbytes / copy_s / 1e9,
        "host_gather_gb_per_s": nbytes / gather_s / 1e9,
        "engine_fetch_gb_per_s": nbytes / fetch_s / 1e9,
        "gemm_tflops": 2 * gemm**3 / gemm_s / 1e12,
    }
    for name, transfer, transfer_s in (("h2d_copy", copy, copy_s), ("engine_fetch", fetch, fetch_s)):
        k = max(1, round(transfer_s / gemm_s))
        compute_s = timed(lambda k=k: gemms(k), repeats)

        def both(k=k, transfer=transfer):
            gemms(k)  # queued on the main stream: returns at once
            transfer()  # host gather while the GEMMs run, then the copy on the side stream

        both_s = timed(both, repeats)
        result[name] = {
            "transfer_ms": transfer_s * 1e3,
            "compute_ms": compute_s * 1e3,
            "gemms": k,
            "together_ms": both_s * 1e3,
            "serial_ms": (transfer_s + compute_s) * 1e3,
            "overlap": (transfer_s + compute_s - both_s) / min(transfer_s, compute_s),
        }
    return result


def planned_prefill(model, engine, repeats: int, length: int = 2048, chunk: int = 256) -> dict:
    """A chunked prefill served forward by forward, against the same prefill announced with `engine.plan` (a background
    thread gathers each next chunk's rows and starts their copy while the current chunk computes)."""
    prompt = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(engine.device)

    def served():
        return generate(model, prompt, 1, prefill_chunk_size=chunk)

    def planned():
        engine.plan(prompt, chunk_size=chunk)
        return generate(model, prompt, 1, prefill_chunk_size=chunk)

    before = engine.stats["planned_forwards"]
    served_s = timed(served, repeats)
    planned_s = timed(planned, repeats)
    chunks = -(-length // chunk)
    planned_forwards = engine.stats["planned_forwards"] - before
    same = torch.equal(served().cpu(), planned().cpu())
    return {
        "prompt_tokens": length,
        "chunk": chunk,
        "served_tokens_per_s": length / served_s,
        "planned_tokens_per_s": length / planned_s,
        "planned_over_served": served_s / planned_s,
        "planned_forwards_per_prefill": planned_forwards / (repeats + 1),
        "expected_planned_forwards_per_prefill": chunks,
        "same_tokens": same,
    }


def run_benchmarks(result: dict, deadline: float, quick: bool) -> bool:
    """Fills `result["benchmarks"]` and `result["parts"]`; returns False if a part raised."""
    from stem_hf.offload import StemOffloadEngine

    parts, bench = result["parts"], result.setdefault("benchmarks", {})
    repeats, new_tokens = (2, 16) if quick else (3, 64)
    device = torch.device("cuda", torch.cuda.current_device())
    ok = True

    def left() -> float:
        return deadline - time.monotonic()

    def part(name: str, needs_s: float, fn) -> None:
        nonlocal ok
        if left() < needs_s:
            parts[name] = f"skipped: {left():.0f} s left of the budget, {needs_s:.0f} s needed"
            log(parts[name])
            return
        log(f"{name} ...")
        start = time.monotonic()
        try:
            fn()
            parts[name] = "ran"
        except Exception as error:  # noqa: BLE001 - recorded in the JSON, the other parts still run
            ok = False
            parts[name] = f"error: {type(error).__name__}: {error}"
            bench.setdefault("errors", {})[name] = traceback.format_exc()[-3000:]
            log(parts[name])
        log(f"{name}: {time.monotonic() - start:.1f} s")

    state = {}

    def setup():
        gc.collect()
        torch.cuda.empty_cache()
        model, base, info = build_model(device)
        state.update(model=model, base=base)
        generator = torch.Generator().manual_seed(0)
        state["prompts"] = {
            b: torch.randint(3, model.config.vocab_size, (b, 128), generator=generator).to(device) for b in (1, 8)
        }
        bench["model"] = info | {"dense_static_mib": (allocated() - base) / MIB}

    part("setup", 30, setup)
    if "model" not in state:
        for name in ("decode", "overlap", "planned_prefill", "memory"):
            parts[name] = "skipped: the benchmark model could not be built"
        return ok
    model, base, prompts = state["model"], state["base"], state["prompts"]
    decode, generated = bench.setdefault("decode", {}), {}
    decode["new_tokens"], decode["prompt_tokens"], decode["repeats"] = new_tokens, 128, repeats

    def served(name: str, **engine_kwargs):
        """Decode with the tables where they are (no engine), or served by an offload engine of `engine_kwargs`."""

        def fn():
            with torch.no_grad():
                if not engine_kwargs:
                    decode[name], generated[name] = decode_speed(model, prompts, new_tokens, repeats, base)
                    return
                with StemOffloadEngine(model, **engine_kwargs) as engine:
                    if not engine.cuda or engine.stream is None:
                        raise RuntimeError(f"the engine serves {engine.device} with no side stream, not the GPU")
                    decode[name], generated[name] = decode_speed(model, prompts, new_tokens, repeats, base)
                    decode[name]["engine"] = engine.stats
                    if engine.cache is None and not engine.store.int8:  # the same engine: plan and overlap
                        part(
                            "planned_prefill",
                            40,
                            lambda: bench.update(planned_prefill=planned_prefill(model, engine, repeats)),
                        )
                        part("overlap", 40, lambda: bench.update(overlap=overlap(engine, repeats)))

        return fn

    part("decode_host_tables", 40, served("host_tables"))
    part("decode_offload_no_cache", 40, served("offload_no_cache", cache_tokens=0))
    part("decode_offload_cache_4096", 40, served("offload_cache_4096", cache_tokens=4096))
    part("decode_offload_int8_cache_4096", 40, served("offload_int8_cache_4096", cache_tokens=4096, int8=True))

    def resident():
        """The same decode with the tables moved to the GPU (what `keep_tables_on_cpu=False` does)."""
        tables = model.model.stem_tables
        model.config.keep_tables_on_cpu = tables.config.keep_tables_on_cpu = False
        tables.to(device)
        if any(t.weight.device.type != "cuda" for t in tables.values()):
            raise RuntimeError("keep_tables_on_cpu=False did not move the tables to the GPU")
        served("resident")()

    part("decode_resident", 40, resident)

    def memory():
        table_mib = bench["model"]["table_bytes"] / MIB
        rows = {
            name: {"static_mib": d["static_mib"], "peak_mib": d["peak_mib"]}
            for name, d in decode.items()
            if isinstance(d, dict) and "static_mib" in d
        }
        out = {"table_mib": table_mib, "by_variant": rows}
        if "resident" in rows and "host_tables" in rows:
            saved = rows["resident"]["static_mib"] - rows["host_tables"]["static_mib"]
            out["static_saved_mib"] = saved
            out["static_saved_over_table_bytes"] = saved / table_mib
            out["peak_saved_mib"] = rows["resident"]["peak_mib"] - rows["host_tables"]["peak_mib"]
        bench["memory"] = out

    part("memory", 0, memory)
    exact = [
        name for name in ("host_tables", "offload_no_cache", "offload_cache_4096", "resident") if name in generated
    ]
    decode["same_tokens_bf16_variants"] = {
        "compared": exact,
        "same": all(torch.equal(generated[exact[0]][b], generated[name][b]) for name in exact for b in prompts)
        if exact
        else None,
    }
    if "offload_int8_cache_4096" in generated and exact:
        ref, got = generated[exact[0]], generated["offload_int8_cache_4096"]
        decode["int8_token_agreement"] = {
            str(b): (ref[b][:, 128:] == got[b][:, 128:]).float().mean().item() for b in prompts
        }
    # The lookup's kernels first (about a minute, its compiles included), so bench_gpu keeps the rest of the budget.
    part("lookup_kernel", 150, lambda: lookup_kernel(min(deadline, time.monotonic() + 120), quick, bench))
    part("bench_gpu", 90, lambda: bench_gpu(deadline, quick, bench))
    part("host_decode", 60, lambda: run_script("bench_host_decode", HOST_DECODE, deadline, bench, suffix="_gpu"))
    part("profile", 60, lambda: profile(deadline, bench))
    part("host_gather", 40, lambda: run_script("bench_host_gather", ["--repeats", "3"], deadline, bench, suffix="_gpu"))
    host = decode.get("host_tables", {})
    for name in ("offload_no_cache", "offload_cache_4096", "offload_int8_cache_4096", "resident"):
        if name in decode and host:
            decode.setdefault("decode_over_host_tables", {})[name] = {
                b: decode[name][b]["decode_tokens_per_s"] / host[b]["decode_tokens_per_s"]
                for b in host
                if b.startswith("batch_")
            }
    return ok


def bench_gpu(deadline: float, quick: bool, bench: dict) -> None:
    """`benchmarks/bench_gpu.py` (STEM against dense Llama at the 0.75B shape) in a subprocess, within what is left of
    the budget, into `bench["bench_gpu"]`: its JSON, partial if the time ran out (`complete` says). A run that fails
    keeps the parts it saved, with the error, and raises."""
    quick_args = ["--repeats", "2", "--seq-len", "512", "--new-tokens", "16", "--decode-batches", "1,16"]
    run_script("bench_gpu", quick_args if quick else [], deadline, bench)


# The host_decode part: decoding steps of the 0.75B shape, dense against STEM, resident, host tables and the engine.
HOST_DECODE = ["--device", "cuda", "--shape", "0.75b", "--dtype", "bfloat16", "--repeats", "3"]

# What the profile part profiles: prefill and a train step of dense and STEM beside each other (its `bounds`), and the
# host-table and engine prefills whose slowness the benchmarks show.
PROFILED = ("prefill_dense", "prefill_stem_full_resident", "prefill_stem_1_2_host", "prefill_stem_1_2_engine",
            "train_dense", "train_stem_1_2_resident")  # fmt: skip


def profile(deadline: float, bench: dict) -> None:
    """`benchmarks/profile_gpu.py` over `PROFILED` at the 0.75B shape, into `bench["profile"]`, as `bench_gpu`."""
    run_script("profile_gpu", ["--only", ",".join(PROFILED)], deadline, bench, key="profile")


def lookup_kernel(deadline: float, quick: bool, bench: dict) -> None:
    """`benchmarks/bench_lookup_kernel.py` at one layer of 8192 tokens (the fused lookup's kernels by compile mode, and
    the table gradient's sum into distinct rows four ways) into `bench["lookup_kernel"]`, as `bench_gpu`."""
    run_script("bench_lookup_kernel", ["--tokens", "8192"] + (["--rounds", "3"] if quick else []), deadline, bench,
               key="lookup_kernel")  # fmt: skip


def run_script(
    name: str,
    args: list[str],
    deadline: float,
    bench: dict,
    key: str | None = None,
    results: str | None = None,
    suffix: str = "",
) -> None:
    """`benchmarks/{name}.py` in a subprocess until 20 s before `deadline`, its JSON (`--out
    {results}/{name}{suffix}.json`, by default in `benchmarks/results`; `suffix="_gpu"` for a script whose default JSON
    holds this project's CPU figures) into `bench[key or name]`, partial if the time ran out. A run that fails keeps
    what it saved, with the error, and raises."""
    out = os.path.join(results or os.path.join(REPO, "benchmarks/results"), f"{name}{suffix}.json")
    command = [sys.executable, os.path.join(REPO, f"benchmarks/{name}.py"), "--out", out, *args]
    timeout = deadline - time.monotonic() - 20
    with contextlib.suppress(FileNotFoundError):
        os.remove(out)  # a result left by an earlier run must not pass for this one's
    env = repo_env()
    failure = None
    try:
        run = subprocess.run(command, cwd=REPO, timeout=timeout, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
        if run.returncode != 0:
            failure = f"{name}.py: exit status {run.returncode}: {run.stderr[-2000:]}"
    except subprocess.TimeoutExpired:
        log(f"{name}: stopped after {timeout:.0f} s; keeping the parts it finished")
    if os.path.exists(out):
        with open(out) as f:
            bench[key or name] = json.load(f)
    elif failure is None:
        failure = f"{name}.py saved no result: no part finished in time"
    if failure:
        raise RuntimeError(failure)


# ----------------------------------------------------------------------------------------------------------------------


def device_info() -> dict:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    info = {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "count": torch.cuda.device_count(),
        "bf16_native": torch.cuda.is_bf16_supported(including_emulation=False),
    }
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        info["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        info["driver"] = None
    return info


def emit(result: dict, out_path: str | None, stream) -> None:
    text = json.dumps(result, indent=2, default=str)
    if out_path:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path + ".tmp", "w") as f:
            f.write(text + "\n")
        os.replace(out_path + ".tmp", out_path)
    print(text, file=stream, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks/results/gpu_check.json"))
    parser.add_argument("--budget-s", type=float, default=570.0, help="the whole check's wall-time budget")
    parser.add_argument("--tests-timeout-s", type=float, default=300.0)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-benchmarks", action="store_true")
    parser.add_argument("--quick", action="store_true", help="fewer repeats and decode tokens")
    args = parser.parse_args()
    start = time.monotonic()

    if not torch.cuda.is_available():
        result = {
            "status": "skipped",
            "reason": "needs a CUDA GPU; none visible",
            "torch": torch.__version__,
            "cuda_build": torch.version.cuda,
            "interpreter": sys.executable,
            "parts": {"tests": "skipped: no CUDA GPU", "benchmarks": "skipped: no CUDA GPU"},
        }
        print(json.dumps(result), flush=True)  # nothing is saved: a skip never overwrites a GPU run's results
        return 0

    stdout, deadline = sys.stdout, start + args.budget_s
    sys.stdout = sys.stderr  # stdout carries the one JSON object; anything else printed goes to stderr
    result = {"status": "running", "device": device_info(), **versions(), "parts": {}}
    state = {"pytest": None}
    lock = threading.Lock()

    def watchdog():
        with lock:
            process = state.get("pytest")
            if process is not None:
                process.kill()
            result["status"] = "timeout"
            result["reason"] = f"the {args.budget_s:.0f} s budget ran out; what ran is in `parts`"
            result["wall_time_s"] = round(time.monotonic() - start, 1)
            emit(result, args.out, stdout)
            os._exit(3)

    timer = threading.Timer(args.budget_s + 15, watchdog)  # the parts keep to the budget; this catches a hang
    timer.daemon = True
    timer.start()

    tests_ok, bench_ok = True, True
    if args.skip_tests:
        result["parts"]["tests"] = "skipped: --skip-tests"
    else:
        log(f"pytest {' '.join(TEST_FILES)}")
        timeout = min(args.tests_timeout_s, deadline - time.monotonic() - 30)
        log_path = os.path.join(os.path.dirname(os.path.abspath(args.out)), "gpu_check_pytest.log")
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        tests = run_tests(TEST_FILES, timeout, log_path, state)
        result["tests"] = tests
        tests_ok = tests.get("returncode") == 0 and not tests["timed_out"] and not tests.get("error")
        # A CUDA test that skips on a GPU did not run: that is a failure of the check, not a pass.
        tests["gpu_tests_skipped"] = sum("test_gpu" in t["test"] for t in tests.get("skipped_tests", []))
        tests_ok = tests_ok and tests["gpu_tests_skipped"] == 0
        if tests["timed_out"]:
            result["parts"]["tests"] = f"timed out after {timeout:.0f} s"
        elif tests.get("error"):
            result["parts"]["tests"] = "error: " + tests["error"][:300]
        elif tests["gpu_tests_skipped"]:
            result["parts"]["tests"] = f"ran: {tests['gpu_tests_skipped']} CUDA tests skipped on a GPU"
        else:
            result["parts"]["tests"] = "ran" if tests_ok else "ran: failures"
        log(
            f"tests: {tests.get('passed')} passed, {tests.get('failures')} failed, {tests.get('errors')} errors, "
            f"{tests.get('skipped')} skipped in {tests['wall_s']} s"
        )
    if args.skip_benchmarks:
        result["parts"]["benchmarks"] = "skipped: --skip-benchmarks"
    else:
        with contextlib.redirect_stdout(sys.stderr):
            bench_ok = run_benchmarks(result, deadline, args.quick)

    with lock:
        timer.cancel()
        result["status"] = "ok" if tests_ok and bench_ok else ("tests_failed" if not tests_ok else "benchmark_error")
        result["wall_time_s"] = round(time.monotonic() - start, 1)
        emit(result, args.out, stdout)
    return 0 if tests_ok and bench_ok else (1 if not tests_ok else 2)


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    sys.exit(main())
