"""STEM against dense served as `transformers serve` serves: continuous batching (`generate_batch`), requests of
several prompt lengths packed into one row over a paged cache, greedy. A dense Llama and STEM models of the same shape
(`bench_gpu` shapes, random weights, tables resident), all in memory, served in turn round by round (in reverse order
every other round, as `bench_gpu.paired_s` times, so that a drift of the machine's speed hits each alike). Per model:
the median wall seconds to serve every request, generated tokens per second, and for STEM the speedup over dense
beside the FLOP prediction (`accounting.flops_per_token` at the mean context), and whether each request's tokens are
those of greedy decoding of that prompt alone by full forwards without a cache (`same_tokens_as_uncached`; random bf16
weights have flat logits, so a difference can be a near tie). Each timing is of a warm manager: in each round a
model's manager serves the requests once untimed (its CUDA graphs captured, its cache sized), then once timed, and
stops, so that no manager runs beside another.

On CUDA, `--cuda-graphs on` captures each step's forward into a graph (what continuous batching does by default with
flash attention), which takes the launching thread's Python out of each step; `off` runs every step eagerly. On a CPU
there are no graphs.

    python benchmarks/bench_serve.py                     # CPU, tiny shape: bench_serve.json
    python benchmarks/bench_serve.py --device cuda --shape 0.75b --dtype bfloat16 --requests 64 --cuda-graphs on \
        --out benchmarks/results/bench_serve_gpu.json
"""

import argparse
import statistics
import time

import torch
import transformers
from bench_gpu import SHAPES, VOCAB, build, predicted, save, specs, sync, token_ids
from tqdm import tqdm
from transformers import ContinuousBatchingConfig, GenerationConfig, logging

from stem_hf.cli_args import positive_int, positive_ints
from stem_hf.remote_check import greedy_without_cache


def prompts(args) -> list[list[int]]:
    """`--requests` Zipf prompts, their lengths cycling through `--prompt-lens`."""
    lengths = [args.prompt_lens[i % len(args.prompt_lens)] for i in range(args.requests)]
    vocab = VOCAB[args.shape]
    return [token_ids("zipf", (1, n), vocab, torch.device("cpu"), seed=i)[0].tolist() for i, n in enumerate(lengths)]


def collect(manager, requests: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Every request's generated tokens from a started continuous batching `manager`, in the requests' order."""
    ids = manager.add_requests(inputs=requests, max_new_tokens=new_tokens)
    results = {}
    while len(results) < len(ids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            results[result.request_id] = result
        elif result is None and not manager.is_running():
            raise RuntimeError("continuous batching's thread stopped: its log says why")
    failed = [request for request, result in results.items() if result.error is not None]
    if failed:
        raise RuntimeError(f"continuous batching failed requests {failed}: {results[failed[0]].error}")
    return [results[request].generated_tokens for request in ids]


def served_s(model, requests: list[list[int]], args) -> tuple[float, list[list[int]]]:
    """Seconds for a continuous batching manager of `model` to serve `requests` once it has served them already (its
    CUDA graphs captured, its cache sized), and their tokens. The manager stops after: none runs beside another model's
    (on a CPU, managers left running slowed the ones timed after them)."""
    greedy = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    graphs = {"on": True, "off": False}.get(args.cuda_graphs)
    config = ContinuousBatchingConfig(use_cuda_graph=graphs) if model.device.type == "cuda" else None
    with model.continuous_batching_context_manager(
        generation_config=greedy, continuous_batching_config=config, block=True, timeout=60, warmup=False
    ) as manager:
        collect(manager, requests, args.new_tokens)
        sync(model.device)
        start = time.perf_counter()
        tokens = collect(manager, requests, args.new_tokens)
        sync(model.device)
        return time.perf_counter() - start, tokens


def alone(model, requests: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each request's greedy tokens from full forwards of its prompt alone, without a cache: the reference."""
    out = []
    for prompt in requests:
        with torch.no_grad():
            tokens = greedy_without_cache(model, torch.tensor([prompt], device=model.device), new_tokens)
        out.append(tokens[0, len(prompt) :].tolist())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--specs", type=specs, default=["1/2"], help="STEM ratios, comma-separated")
    parser.add_argument("--requests", type=positive_int, default=16)
    parser.add_argument("--prompt-lens", type=positive_ints, default=[16, 48, 96], help="cycled over the requests")
    parser.add_argument("--new-tokens", type=positive_int, default=32)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--cuda-graphs", choices=("default", "on", "off"), default="default")
    parser.add_argument("--threads", type=positive_int, help="torch's intra-op threads (default: torch's)")
    parser.add_argument("--out", default="benchmarks/results/bench_serve.json")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.set_verbosity_error()  # continuous batching logs its settings at every call
    requests = prompts(args)
    context = sum(len(p) + (args.new_tokens + 1) / 2 for p in requests) / len(requests)
    names = ["dense", *(f"stem_{spec.replace('/', '_')}" for spec in args.specs)]
    models = {
        name: build(args.shape, spec, device, dtype) for name, spec in zip(names, [None, *args.specs], strict=True)
    }
    report = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        **{k: v for k, v in vars(args).items() if k != "out"},
        "threads": torch.get_num_threads(),
        "mean_context": round(context, 1),
        "complete": False,
    }
    start = time.perf_counter()
    times, served = {name: [] for name in names}, {}
    for round_ in tqdm(range(args.repeats), desc="rounds"):  # in turn, in reverse order every other round
        for name in names if round_ % 2 == 0 else names[::-1]:
            seconds, served[name] = served_s(models[name], requests, args)
            times[name].append(seconds)
    tokens = args.requests * args.new_tokens
    for name, model in tqdm(models.items(), desc="checking tokens"):
        seconds = times[name]
        median = statistics.median(seconds)
        row = {
            "s": round(median, 4),
            "tokens_per_s": round(tokens / median, 1),
            "rounds_s": [round(t, 4) for t in seconds],
        }
        if name != "dense":
            row["speedup"] = round(report["dense"]["s"] / median, 3)
            row["predicted_speedup"] = round(predicted(model.config, context), 3)
            row["same_tokens_as_uncached"] = served[name] == alone(model, requests, args.new_tokens)
        report[name] = row
    report["wall_s"], report["complete"] = round(time.perf_counter() - start, 1), True
    save(report, args.out)
    print({name: report[name] for name in names})


if __name__ == "__main__":
    main()
