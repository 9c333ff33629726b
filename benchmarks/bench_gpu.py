"""STEM against a dense Llama of the same shape on one accelerator, side by side in one process: prefill, a train step
with its optimizer, and greedy decode; tables resident on the device, in host memory (the model's own gather) and
served by `StemOffloadEngine`; uniform and Zipf-distributed ids. Every ratio sits next to the speedup that FLOPs
predict (`accounting.flops_per_token`). Medians of `--repeats` runs after a warm-up. Saves JSON.

    python benchmarks/bench_gpu.py                                   # CUDA, the 0.75B shape: a few minutes on one H100
    python benchmarks/bench_gpu.py --device cpu --shape small --compile --out benchmarks/results/bench_gpu_cpu.json
    python benchmarks/bench_gpu.py --device cpu --shape medium --batch-size 1 --seq-len 512 --compile --dtype float32 \
        --skip train,decode --out benchmarks/results/bench_gpu_cpu_medium.json

Models are built on the device in bf16 (tables too), never initialized on the host. `gpu_check.sh` runs it.
"""

import argparse
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial

import torch
from torch._dynamo.utils import counters
from tqdm import tqdm
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM, LogitsProcessorList

from stem_hf import StemConfig, StemForCausalLM
from stem_hf.accounting import flops_per_token
from stem_hf.cli_args import int_at_least, positive_int, positive_ints
from stem_hf.modeling_stem import FUSED_LOOKUP_MIN_TOKENS, fuses_lookups_on
from stem_hf.offload import StemOffloadEngine
from stem_hf.training import RowSparseAdamW, copy_table_grads_behind, param_groups, use_sparse_table_grads

SHAPES = {
    "0.75b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=12, num_attention_heads=16),
    "medium": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=16),
    "small": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4),
}
VOCAB = {"0.75b": 32000, "medium": 16384, "small": 8192, "tiny": 512}
SPECS = ("1/3", "1/2", "full")


SKIPPABLE = ("prefill", "train", "decode", "host")


def skips(text: str) -> set[str]:
    """The type of `--skip`: parts among `SKIPPABLE`, comma-separated (empty: none)."""
    chosen = set(filter(None, text.split(",")))
    if chosen - set(SKIPPABLE):
        raise argparse.ArgumentTypeError(f"must be among {', '.join(SKIPPABLE)}, comma-separated, not {text!r}")
    return chosen


def hosts(args, device: torch.device) -> bool:
    """Whether the host-table and engine cases run: on an accelerator (on a CPU, host is resident), unless skipped."""
    return device.type != "cpu" and "host" not in args.skip


def specs(text: str) -> list[str]:
    """The type of `--specs`: STEM ratios among `SPECS`, comma-separated."""
    chosen = text.split(",")
    if len(set(chosen)) < len(chosen) or any(spec not in SPECS for spec in chosen):
        raise argparse.ArgumentTypeError(f"must be among {', '.join(SPECS)}, comma-separated, not {text!r}")
    return chosen


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_s(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall seconds of `fn` over `repeats` runs after one warm-up, the device synchronized around each."""
    return statistics.median(paired_s([fn], repeats, device)[0])


def paired_s(fns: list[Callable[[], object]], repeats: int, device: torch.device) -> list[list[float]]:
    """Wall seconds of each of `fns` over `repeats` rounds after one warm-up each, run in turn within a round (in
    reverse order every other round), so that a drift of the machine's speed hits each alike."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for round_ in range(repeats):
        order = range(len(fns)) if round_ % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            sync(device)
            start = time.perf_counter()
            fns[i]()
            sync(device)
            times[i].append(time.perf_counter() - start)
    return times


def token_ids(kind: str, shape: tuple[int, int], vocab: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """`uniform` ids, or `zipf` ids (frequency of rank r proportional to 1/r^1.1, as text's tokens roughly are)."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        ids = torch.randint(0, vocab, shape, generator=generator)
    else:
        weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
        ids = torch.multinomial(weights, shape[0] * shape[1], replacement=True, generator=generator).view(shape)
    return ids.to(device)


def config_kwargs(shape: str) -> dict:
    return dict(
        **SHAPES[shape],
        vocab_size=VOCAB[shape],
        num_key_value_heads=SHAPES[shape]["num_attention_heads"],
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def build(shape: str, spec: str | None, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """A dense Llama (`spec` None) or a STEM model, random, in `dtype` (tables too), built on `device` with its tables
    resident."""
    torch.manual_seed(0)
    with torch.device(device):
        if spec is None:
            model = LlamaForCausalLM(LlamaConfig(**config_kwargs(shape)))
        else:
            config = StemConfig(**config_kwargs(shape), stem_layers=spec, table_dtype=str(dtype).removeprefix("torch."))
            config.keep_tables_on_cpu = False
            model = StemForCausalLM(config)
    return model.to(dtype).eval()


def to_host(model) -> None:
    """Tables into host memory, where `keep_tables_on_cpu` keeps them; the dense part stays on the device."""
    model.config.keep_tables_on_cpu = True
    model.model.stem_tables.to("cpu")


def fresh_compiles() -> None:
    """Forgets every compiled graph before the next compiled model. All STEM models share one forward's code, whose
    compiled variants dynamo caps (`recompile_limit`); past the cap a `fullgraph=True` compile fails (without it, the
    call would run eager). What was forgotten recompiles in the warm-up that every timing has."""
    torch.compiler.reset()


def free() -> None:
    """Returns the device memory of models the caller has dropped."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def predicted(config: StemConfig, context: float) -> float:
    """The speedup over dense that forward FLOPs per token predict (a train step scales the same way)."""
    return flops_per_token(config, context, dense=True) / flops_per_token(config, context)


def prefill(model, ids: torch.Tensor, repeats: int, device: torch.device) -> float:
    with torch.inference_mode():
        return median_s(lambda: model(ids), repeats, device)


def first_then_prefill(model, ids: torch.Tensor, repeats: int, device: torch.device) -> tuple[float, float]:
    """The seconds of a first forward (host tables' first: its pinned staging memory is allocated then, where later
    forwards reuse it), then `prefill`'s median after it."""
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        model(ids)
    sync(device)
    return time.perf_counter() - start, prefill(model, ids, repeats, device)


def train_step_s(
    model, ids: torch.Tensor, repeats: int, device: torch.device, optimizer, compiled: bool = False, fresh: bool = True
) -> float:
    """A train step: forward and loss, backward, the optimizer's step; with `compiled`, forward and backward through
    `torch.compile(model)` (the optimizer's step eager), `fullgraph=True` unless the tables' gradients are sparse
    (whose rows a compiled forward gathers outside the graph), from fresh compiles unless `fresh` is False (the same
    model compiled just before: its graphs serve again)."""
    model.train()
    forward = model
    if compiled:
        if fresh:
            fresh_compiles()
        sparse = any(table.sparse for table in getattr(model.base_model, "stem_tables", {}).values())
        forward = torch.compile(model, fullgraph=not sparse)
    seconds = median_s(partial(one_step, forward, ids, optimizer), repeats, device)
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    return seconds


def one_step(forward, ids: torch.Tensor, optimizer) -> None:
    """One train step: forward and loss, backward, the optimizer's step."""
    optimizer.zero_grad(set_to_none=True)
    forward(ids, labels=ids).loss.backward()
    optimizer.step()


def lookup_step(model, ids: torch.Tensor, optimizer, fused: bool) -> None:
    """One eager train step with `fused_table_lookup` set to `fused`."""
    with lookup(model, fused):
        one_step(model, ids, optimizer)


def paired_train_s(model, ids: torch.Tensor, args, device: torch.device, optimizer, fuses: bool) -> list[float]:
    """Median seconds of a train step with `fused_table_lookup` as the default resolves it here (`fuses`) and with
    the other setting, timed in turn round by round."""
    model.train()
    steps = [partial(lookup_step, model, ids, optimizer, fused) for fused in (fuses, not fuses)]
    times = paired_s(steps, args.repeats, device)
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    return [statistics.median(t) for t in times]


def step_peak(model, ids: torch.Tensor, device: torch.device, optimizer, fused: bool) -> int:
    """Peak allocated CUDA memory during one train step with `fused_table_lookup=fused` (everything allocated then,
    the model and the optimizer's state included)."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    lookup_step(model, ids, optimizer, fused)
    sync(device)
    peak = torch.cuda.max_memory_allocated(device)
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    return peak


class StepClock:
    """Stamps when each generation step's logits are ready: the first stamp ends the prefill, the rest are decode
    steps, so a decode step's time is one measurement."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores):
        sync(self.device)
        self.times.append(time.perf_counter())
        return scores


def decode_once(model, prompt: torch.Tensor, new: int, device: torch.device, **kwargs) -> tuple[float, torch.Tensor]:
    """Seconds per greedy decode step of one `generate` (the prefill excluded), and the tokens it generated."""
    clock = StepClock(device)
    greedy = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    clocked = LogitsProcessorList([clock])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), logits_processor=clocked, **greedy, **kwargs)
    return (clock.times[-1] - clock.times[0]) / (len(clock.times) - 1), out.cpu()


def decode_other_lookup(model, fused: bool, prompt: torch.Tensor, **kwargs) -> tuple[float, torch.Tensor]:
    with lookup(model, fused):
        return decode_once(model, prompt, **kwargs)


def decode_served(engine: StemOffloadEngine, prompt: torch.Tensor, **kwargs) -> tuple[float, torch.Tensor]:
    with engine.attach():
        return decode_once(engine.model, prompt, **kwargs)


def paired_decode(variants: dict[str, Callable[[torch.Tensor], tuple]], prompt: torch.Tensor, repeats: int) -> dict:
    """Per variant: median seconds per decode step, its last tokens, and whether every run generated them. The
    variants run in turn within each of `repeats` rounds (in reverse order every other round) after one warm-up each
    (which compiles), as `paired_s` times prefills: a drift of the machine's speed hits each alike."""
    outs = {name: [run(prompt)[1]] for name, run in variants.items()}
    steps = {name: [] for name in variants}
    for round_ in range(repeats):
        for name in list(variants) if round_ % 2 == 0 else reversed(list(variants)):
            step, out = variants[name](prompt)
            steps[name].append(step)
            outs[name].append(out)
    return {
        name: (statistics.median(steps[name]), outs[name][-1], all(torch.equal(o, outs[name][-1]) for o in outs[name]))
        for name in variants
    }


def decode_step_s(model, prompt: torch.Tensor, new: int, repeats: int, device: torch.device, **kwargs) -> tuple:
    """Median seconds per greedy decode step, the tokens generated, and whether every run generated them."""
    run = partial(decode_once, model, new=new, device=device, **kwargs)
    return paired_decode({"model": run}, prompt, repeats)["model"]


@contextmanager
def lookup(model, fused: bool):
    """`model` with `fused_table_lookup` set to `fused` for the block's forwards."""
    setting = model.config.fused_table_lookup
    model.config.fused_table_lookup = fused
    try:
        yield model
    finally:
        model.config.fused_table_lookup = setting


def default_fuses(args, device: torch.device) -> bool:
    """What `fused_table_lookup=None`, the default, does for a forward of `--batch-size` x `--seq-len` here."""
    return fuses_lookups_on(device) and args.batch_size * args.seq_len >= FUSED_LOOKUP_MIN_TOKENS


def with_lookup(model, fused: bool, *args):
    with lookup(model, fused):
        return model(*args)


def last_logits(model, prompts: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Per batch, the prompt's next-token logits (float32, on the host) of one forward."""
    with torch.inference_mode():
        return {b: model(p).logits[:, -1].float().cpu() for b, p in prompts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="0.75b", choices=sorted(SHAPES))
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--seq-len", type=positive_int, default=1024)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--decode-batches", type=positive_ints, default="1,16,64")
    parser.add_argument("--prompt-len", type=positive_int, default=256)
    parser.add_argument("--new-tokens", type=int_at_least(2), default=64, help="a decode step needs two stamps")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd prefill and train steps, "
                        "and static-cache compiled decoding")  # fmt: skip
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--skip", type=skips, default="", help="comma-separated parts to leave out: "
                        "prefill, train, decode, host (the host-table and engine cases of each)")  # fmt: skip
    parser.add_argument("--specs", type=specs, default=",".join(SPECS), help="STEM ratios of prefill and train "
                        "(train times 1/2 and full only; decode 1/2 whatever this says)")  # fmt: skip
    parser.add_argument("--out", default="benchmarks/results/bench_gpu.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    given = {**vars(args), "skip": ",".join(sorted(args.skip))}  # as typed: a set is no JSON
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "args": given,
              "torch": torch.__version__, "threads": torch.get_num_threads(), "complete": False}  # fmt: skip
    for name, run in (("prefill", run_prefill), ("train", run_train), ("decode", run_decode)):
        if name not in args.skip:
            report[name] = run(args, device)
            save(report, args.out)  # after each part: a run stopped by a time limit keeps what it measured
    report["complete"] = True
    save(report, args.out)
    print(json.dumps(report, indent=2))


def save(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(json.dumps(report, indent=2) + "\n")
    os.replace(path + ".tmp", path)


def run_prefill(args, device: torch.device) -> dict:
    """Forward of batch x seq tokens: each STEM ratio resident, timed in turn with dense (both models in memory), then
    host (1/2 and full) and engine (1/2)."""
    shape, dtype = (args.batch_size, args.seq_len), getattr(torch, args.dtype)
    ids = {kind: token_ids(kind, shape, VOCAB[args.shape], device) for kind in ("uniform", "zipf")}
    dense = build(args.shape, None, device, dtype)
    dense_compiled = torch.compile(dense, fullgraph=True) if args.compile else None
    out, dense_times = {"dense_ms": {}}, {"uniform": [], "zipf": [], "compiled": []}
    fuses = default_fuses(args, device)
    out["fused_lookup_by_default"] = fuses
    for spec in tqdm([spec for spec in SPECS if spec in args.specs], desc="prefill"):
        model = build(args.shape, spec, device, dtype)
        context = (args.seq_len + 1) / 2
        row = {"predicted_speedup": round(predicted(model.config, context), 3)}
        pairs = {kind: (dense, model, x) for kind, x in ids.items()}
        if args.compile:
            fresh_compiles()  # dense recompiles in its warm-up
            pairs["compiled"] = (dense_compiled, torch.compile(model, fullgraph=True), ids["uniform"])
        for kind, (reference, stem, x) in pairs.items():
            fns = [partial(reference, x), partial(stem, x)]
            if kind != "compiled":  # and the other `fused_table_lookup` than the default, in the same rounds
                fns.append(partial(with_lookup, model, not fuses, x))
            with torch.inference_mode():
                reference_s, stem_s, *other_s = paired_s(fns, args.repeats, device)
            dense_times[kind] += reference_s
            dense_ms, stem_ms = statistics.median(reference_s) * 1e3, statistics.median(stem_s) * 1e3
            key = "ms" if kind == "compiled" else "resident_ms"
            row[kind] = {
                "dense_ms": round(dense_ms, 3),
                key: round(stem_ms, 3),
                "speedup": round(dense_ms / stem_ms, 3),
            }
            if other_s:
                other_ms = statistics.median(other_s[0]) * 1e3
                fused_ms, unfused_ms = (stem_ms, other_ms) if fuses else (other_ms, stem_ms)
                row[kind].update(
                    fused_lookup=fuses,
                    other_lookup_ms=round(other_ms, 3),
                    other_lookup_speedup=round(dense_ms / other_ms, 3),
                    fused_over_unfused=round(unfused_ms / fused_ms, 3),
                )
        if spec != "1/3" and hosts(args, device):
            to_host(model)
            for kind, x in ids.items():
                first, host = first_then_prefill(model, x, args.repeats, device)
                row[kind]["host_first_ms"] = round(first * 1e3, 3)
                row[kind]["host_ms"] = round(host * 1e3, 3)
                row[kind]["host_vs_resident"] = round(row[kind]["resident_ms"] / (host * 1e3), 3)
                if spec == "1/2":
                    with StemOffloadEngine(model, device=device).attach():
                        first, engine = first_then_prefill(model, x, args.repeats, device)
                    row[kind]["engine_first_ms"] = round(first * 1e3, 3)
                    row[kind]["engine_ms"] = round(engine * 1e3, 3)
                    row[kind]["engine_vs_resident"] = round(row[kind]["resident_ms"] / (engine * 1e3), 3)
        del model
        free()
        out[spec] = row
    out["dense_ms"] = {k: round(statistics.median(v) * 1e3, 3) for k, v in dense_times.items() if v}
    del dense, dense_compiled
    free()
    return out


def run_train(args, device: torch.device) -> dict:
    """A train step with AdamW (dense, each ratio), RowSparseAdamW with sparse table gradients (StemTrainer's default
    path) and its resident row updates eager and compiled (`compiled_rows`, the default on CUDA; on the CPU with
    `--compile` only), and, with host tables (1/2), both again; with `--compile`, forward and backward compiled with
    AdamW (dense table gradients) and with sparse table gradients and RowSparseAdamW (against dense compiled with each
    optimizer)."""
    ids = token_ids("uniform", (args.batch_size, args.seq_len), VOCAB[args.shape], device)
    dense = build(args.shape, None, device, getattr(torch, args.dtype))
    dense_s = train_step_s(dense, ids, args.repeats, device, torch.optim.AdamW(dense.parameters(), lr=1e-5))
    # STEM's RowSparseAdamW runs are compared with dense under RowSparseAdamW too: like with like. Its dense update
    # compiled (`compiled_dense`, CUDA's default) where the row updates are, and the foreach pass beside it.
    compiles = args.compile or device.type == "cuda"
    optimizer = RowSparseAdamW(param_groups(dense, lr=1e-5), compiled_dense=compiles)
    dense_rs = train_step_s(dense, ids, args.repeats, device, optimizer)
    out = {"dense_adamw_ms": round(dense_s * 1e3, 3), "dense_row_sparse_adamw_ms": round(dense_rs * 1e3, 3)}
    del optimizer  # its moments
    dense_foreach = dense_rs
    if compiles:
        optimizer = RowSparseAdamW(param_groups(dense, lr=1e-5), compiled_dense=False)
        dense_foreach = train_step_s(dense, ids, args.repeats, device, optimizer)
        out["dense_row_sparse_adamw_foreach_ms"] = round(dense_foreach * 1e3, 3)
        del optimizer
    if args.compile:
        adamw = torch.optim.AdamW(dense.parameters(), lr=1e-5)
        dense_compiled = train_step_s(dense, ids, args.repeats, device, adamw, compiled=True)
        out["dense_compiled_adamw_ms"] = round(dense_compiled * 1e3, 3)
        row_sparse = RowSparseAdamW(param_groups(dense, lr=1e-5), compiled_dense=True)
        dense_compiled_rs = train_step_s(dense, ids, args.repeats, device, row_sparse, compiled=True, fresh=False)
        out["dense_compiled_row_sparse_adamw_ms"] = round(dense_compiled_rs * 1e3, 3)
        del adamw, row_sparse  # they hold dense's weights and state
    del dense
    free()
    fuses = default_fuses(args, device)
    out["fused_lookup_by_default"] = fuses
    for spec in tqdm([spec for spec in ("1/2", "full") if spec in args.specs], desc="train"):
        model = build(args.shape, spec, device, getattr(torch, args.dtype))
        row = {"predicted_speedup": round(predicted(model.config, (args.seq_len + 1) / 2), 3)}
        adamw = train_step_s(model, ids, args.repeats, device, torch.optim.AdamW(model.parameters(), lr=1e-5))
        row["adamw"] = {"ms": round(adamw * 1e3, 3), "speedup": round(dense_s / adamw, 3)}
        if args.compile:  # the tables resident, their gradients dense, as for dense's compiled step
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
            compiled = train_step_s(model, ids, args.repeats, device, optimizer, compiled=True)
            row["compiled_adamw"] = {"ms": round(compiled * 1e3, 3), "speedup": round(dense_compiled / compiled, 3)}
            del optimizer
        use_sparse_table_grads(model)  # train() made the tables float32, which sparse gradients need
        groups = param_groups(model, lr=1e-5, row_sparse_tables=True)  # every update eager, below
        sparse = RowSparseAdamW(groups, compiled_rows=False, compiled_dense=False)
        row["row_sparse_adamw"] = {"ms": round(train_step_s(model, ids, args.repeats, device, sparse) * 1e3, 3)}
        row["row_sparse_adamw"]["speedup"] = round(dense_foreach * 1e3 / row["row_sparse_adamw"]["ms"], 3)
        if compiles:  # the resident rows and the dense parameters by compiled functions (compiled in warm-up)
            compiled_rows = RowSparseAdamW(param_groups(model, lr=1e-5, row_sparse_tables=True), compiled_rows=True,
                                           compiled_dense=True)  # fmt: skip
            # With the default `fused_table_lookup` and the other, in turn round by round (`paired_s`).
            ms, other = (round(t * 1e3, 3) for t in paired_train_s(model, ids, args, device, compiled_rows, fuses))
            timed = row["row_sparse_adamw_compiled_rows"] = {"ms": ms, "speedup": round(dense_rs * 1e3 / ms, 3)}
            timed["vs_dense_adamw"] = round(dense_s * 1e3 / ms, 3)  # against dense under torch's AdamW
            timed.update(fused_lookup=fuses, other_lookup_ms=other)
            timed["other_lookup_speedup"] = round(dense_rs * 1e3 / other, 3)
            timed["fused_over_unfused"] = round(other / ms if fuses else ms / other, 3)
            if device.type == "cuda":  # what the fused lookup's backward keeps (gate only) shows in a step's peak
                for key, fused in (("peak_mib", fuses), ("other_lookup_peak_mib", not fuses)):
                    timed[key] = round(step_peak(model, ids, device, compiled_rows, fused) / 2**20, 1)
            del compiled_rows
        if args.compile:  # StemTrainer's path compiled: the tables' rows gathered outside the graph, once per forward
            compiled_rows = RowSparseAdamW(param_groups(model, lr=1e-5, row_sparse_tables=True), compiled_rows=True,
                                           compiled_dense=True)  # fmt: skip
            counters.clear()
            ms = train_step_s(model, ids, args.repeats, device, compiled_rows, compiled=True) * 1e3
            row["compiled_row_sparse_adamw"] = {
                "ms": round(ms, 3),
                "graphs": counters["stats"]["unique_graphs"],  # dynamo's: none would mean it ran eager
                "speedup": round(dense_compiled_rs * 1e3 / ms, 3),
                "vs_dense_compiled_adamw": round(dense_compiled * 1e3 / ms, 3),
                "vs_eager": round(row["row_sparse_adamw_compiled_rows"]["ms"] / ms, 3),  # the same optimizer
            }
            del compiled_rows
        if spec == "1/2" and hosts(args, device):
            to_host(model)
            copy_table_grads_behind(model)  # as StemTrainer marks them for the model's own loss
            # StemTrainer's default over host tables: rows fetched ahead, row gradients back to a host optimizer.
            # Dense parameters by the foreach pass, as in `row_sparse_adamw`, the resident run they are compared with.
            host_sparse = RowSparseAdamW(param_groups(model, lr=1e-5, row_sparse_tables=True), compiled_dense=False)
            host_rs = train_step_s(model, ids, args.repeats, device, host_sparse)
            resident_rs = row["row_sparse_adamw"]["ms"] / 1e3
            row["host_row_sparse_adamw"] = {
                "ms": round(host_rs * 1e3, 3),
                "vs_resident": round(resident_rs / host_rs, 3),
            }
            # The same, the host tables written behind by a worker thread while the GPU goes on
            # (`StemTrainer(write_behind_tables=True)`); each step's forward waits for the writes it reads.
            behind = RowSparseAdamW(param_groups(model, lr=1e-5, row_sparse_tables=True), write_behind=True,
                                    compiled_dense=False)  # fmt: skip
            host_wb = train_step_s(model, ids, args.repeats, device, behind)
            behind.settle()
            row["host_row_sparse_adamw_write_behind"] = {
                "ms": round(host_wb * 1e3, 3),
                "vs_resident": round(resident_rs / host_wb, 3),
                "vs_writing_in_step": round(host_rs / host_wb, 3),
            }
            del host_sparse, behind
        use_sparse_table_grads(model, enable=False)
        copy_table_grads_behind(model, enable=False)
        if spec == "1/2" and hosts(args, device):
            host = train_step_s(model, ids, args.repeats, device, torch.optim.AdamW(model.parameters(), lr=1e-5))
            # torch's AdamW over host tables: dense [vocab, d_ff] gradients on the host, no foreach (two devices).
            row["host_adamw_dense_grads"] = {"ms": round(host * 1e3, 3), "vs_resident": round(adamw / host, 3)}
        del model, sparse
        free()
        out[spec] = row
    return out


def run_decode(args, device: torch.device) -> dict:
    """Greedy decode of `--new-tokens` after a `--prompt-len` prompt, per batch: dense and STEM-1/2 in memory together,
    timed in turn round by round (`paired_decode`): dense, resident and resident with the other `fused_table_lookup`;
    then, the tables moved to host memory, dense, host and engine with a row cache; each ratio against dense from the
    same rounds. Static-cache compiled decoding with `--compile`, timed on its own (each compile starts afresh).
    Tokens are compared with resident's."""
    batches = args.decode_batches
    prompts = {b: token_ids("zipf", (b, args.prompt_len), VOCAB[args.shape], device, seed=b) for b in batches}
    dtype = getattr(torch, args.dtype)
    dense, model = build(args.shape, None, device, dtype), build(args.shape, "1/2", device, dtype)
    context = args.prompt_len + args.new_tokens / 2
    fuses = fuses_lookups_on(device)  # the prompts' prefills; decoding steps of fewer than 128 tokens never fuse
    other = "resident_unfused" if fuses else "resident_fused"  # the other `fused_table_lookup`
    timing = dict(new=args.new_tokens, device=device)
    resident = {
        "dense": partial(decode_once, dense, **timing),
        "resident": partial(decode_once, model, **timing),
        other: partial(decode_other_lookup, model, not fuses, **timing),
    }
    phases = [{b: paired_decode(resident, p, args.repeats) for b, p in prompts.items()}]
    logits = {"resident": last_logits(model, prompts), "resident_again": last_logits(model, prompts)}
    with lookup(model, not fuses):
        logits[other] = last_logits(model, prompts)
    if args.compile:
        compile_config = CompileConfig(fullgraph=True)
        compile_config._compile_all_devices = device.type == "cpu"  # transformers compiles on accelerators only
        compiled = {"cache_implementation": "static", "compile_config": compile_config}
        static = {}
        for name, which in (("dense", dense), ("static_compiled", model)):
            fresh_compiles()
            static[name] = {b: decode_step_s(which, p, args.new_tokens, args.repeats, device, **compiled)
                            for b, p in prompts.items()}  # fmt: skip
        phases.append({b: {name: static[name][b] for name in static} for b in batches})
    if hosts(args, device):
        to_host(model)
        engine = StemOffloadEngine(model, cache_tokens=4096, device=device)
        host = {
            "dense": partial(decode_once, dense, **timing),
            "host": partial(decode_once, model, **timing),
            "engine": partial(decode_served, engine, **timing),
        }
        phases.append({b: paired_decode(host, p, args.repeats) for b, p in prompts.items()})
        logits["host"] = last_logits(model, prompts)
        with engine.attach():
            logits["engine"] = last_logits(model, prompts)
    out = {"predicted_speedup": round(predicted(model.config, context), 3), "fused_lookup_by_default": fuses}
    del dense, model, resident
    if hosts(args, device):
        del engine, host
    free()
    for b in batches:
        first = phases[0][b]["dense"]
        row = {"dense_step_ms": round(first[0] * 1e3, 3), "dense_same_tokens_across_runs": first[2]}
        for phase in phases:
            base = phase[b]["dense"][0]
            for name, (step_s, tokens, repeatable) in phase[b].items():
                if name == "dense":
                    continue
                row[name] = {"step_ms": round(step_s * 1e3, 3), "speedup": round(base / step_s, 3)}
                if phase is not phases[0]:  # its own dense rounds
                    row[name]["dense_step_ms"] = round(base * 1e3, 3)
                # Whether the variant's runs agree among themselves: if resident's own runs differ, tokens that
                # differ from resident's may be kernel order (random bf16 weights have flat logits); if not, they
                # need a look.
                row[name]["same_tokens_across_runs"] = repeatable
                if name != "resident":
                    row[name]["same_tokens_as_resident"] = bool(torch.equal(tokens, phases[0][b]["resident"][1]))
                # The prompt's next-token logits against resident's: kernel order moves them by rounding, a wrong
                # row by far more. Resident against itself says how much rounding differs between two runs.
                again = "resident_again" if name == "resident" else name
                if again in logits:
                    diff = (logits[again][b] - logits["resident"][b]).abs().max().item()
                    row[name]["logits_max_diff_vs_resident"] = round(diff, 5)
        row["resident_logits_std"] = round(logits["resident"][b].std().item(), 5)
        out[f"batch_{b}"] = row
    return out


if __name__ == "__main__":
    main()
