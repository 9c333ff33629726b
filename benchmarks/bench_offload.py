"""The offload engine on the SmolLM2-135M STEM-1/3 of `make demo`: gather throughput against a plain copy of the same
bytes, row-cache hit rates on real text, prefill and decode speed offloaded vs resident, and the cost of int8 tables.

    make demo && .venv/bin/python benchmarks/bench_offload.py   # JSON on stdout and in benchmarks/results/

On a CPU-only machine "offloaded" and "resident" share the host memory, so the speed ratio shows the engine's
overhead, not a transfer saving. Prefill is timed without a cache (every forward fetches its rows), decode with and
without one. With a GPU the script runs the same code on it; it does not yet measure device memory.
"""

import argparse
import json
import os
import statistics
import time

import torch
from transformers import AutoTokenizer

from stem_hf import StemForCausalLM
from stem_hf.assets import corpora
from stem_hf.conversion.report import perplexity
from stem_hf.conversion.text import chunk_texts
from stem_hf.offload import StemHostTables, StemOffloadEngine, StemRowCache


def _median_seconds(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gather_throughput(store: StemHostTables, n: int) -> dict:
    ids = torch.randperm(store.vocab_size, generator=torch.Generator().manual_seed(0))[:n].sort().values
    out = torch.empty((n, *store.data.shape[1:]), dtype=store.data.dtype)
    nbytes = out.numel() * out.element_size()
    source = store.data[:n]  # the same bytes, contiguous: what a plain memory copy moves
    gather_s = _median_seconds(lambda: store.gather(ids, out))
    copy_s = _median_seconds(lambda: out.copy_(source))
    return {
        "tokens": n,
        "bytes": nbytes,
        "gather_gb_per_s": nbytes / gather_s / 1e9,
        "memcpy_gb_per_s": nbytes / copy_s / 1e9,
        "gather_over_memcpy": copy_s / gather_s,
    }


def cache_hit_rates(token_stream: list[int], vocab_size: int, capacities: list[int]) -> dict:
    rates = {}
    for capacity in capacities:
        cache = StemRowCache(capacity, vocab_size, 1, 1, torch.float32, "cpu", scales=False)
        for token in token_stream:  # decode: one token per step
            ids = torch.tensor([token])
            slots = cache.lookup(ids)
            if slots[0] < 0:
                cache.insert(ids, torch.zeros(1, 1, 1), None, keep=torch.empty(0, dtype=torch.long))
        rates[str(capacity)] = cache.hit_rate
    return rates


def speed(model, prompt_ids, new_tokens: int) -> dict:
    prefill_s = _median_seconds(lambda: model(prompt_ids), repeats=3)
    start = time.perf_counter()
    out = model.generate(prompt_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    total = time.perf_counter() - start
    decode_s = max(total - prefill_s, 1e-9)
    return {
        "prefill_tokens_per_s": prompt_ids.numel() / prefill_s,
        "decode_tokens_per_s": (new_tokens - 1) / decode_s,
        "generated": out[0, prompt_ids.shape[1] :].tolist(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="runs/demo/stem-1-3")
    parser.add_argument("--out", default="benchmarks/results/bench_offload.json")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    model = StemForCausalLM.from_pretrained(args.checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    tables = {int(k): m.weight for k, m in model.model.stem_tables.items()}
    heldout = corpora()["heldout"]
    stream = torch.cat(chunk_texts(heldout, tokenizer, None, 4096, 50_000)).tolist()  # held-out text as one stream

    store = StemHostTables(tables)
    result = {"checkpoint": args.checkpoint, "host_table_bytes": store.nbytes, "row_bytes_per_token": store.row_bytes()}
    result["gather"] = [gather_throughput(store, n) for n in (256, 4096)]
    distinct = len(set(stream))
    result["cache_hit_rate_decode"] = {
        "tokens": len(stream),
        "distinct_tokens": distinct,
        "by_capacity": cache_hit_rates(stream, store.vocab_size, [256, 1024, 4096, 16384]),
    }

    prompt = torch.tensor([[tokenizer.bos_token_id, *stream[:511]]])
    with torch.no_grad():
        resident = speed(model, prompt, 32)
        with StemOffloadEngine(model) as engine:
            no_cache = speed(model, prompt, 32)
        with StemOffloadEngine(model, cache_tokens=4096) as engine:
            cached = speed(model, prompt, 32)
        resident_decode = resident["decode_tokens_per_s"]
        result["speed"] = {
            "resident": {k: v for k, v in resident.items() if k != "generated"},
            "offloaded_no_cache": {k: v for k, v in no_cache.items() if k != "generated"},
            "offloaded_cache_4096_decode_tokens_per_s": cached["decode_tokens_per_s"],
            "same_generation": resident["generated"] == no_cache["generated"] == cached["generated"],
            "offloaded_over_resident_prefill": no_cache["prefill_tokens_per_s"] / resident["prefill_tokens_per_s"],
            "offloaded_over_resident_decode_no_cache": no_cache["decode_tokens_per_s"] / resident_decode,
            "offloaded_over_resident_decode_cache_4096": cached["decode_tokens_per_s"] / resident_decode,
            "engine_with_cache": engine.stats,
        }
        chunks = chunk_texts(heldout, tokenizer, tokenizer.bos_token_id, 512, 8_000)
        bf16_ppl = perplexity(model, chunks)
        with StemOffloadEngine(model, int8=True) as engine:
            int8_ppl = perplexity(model, chunks)
        result["int8"] = {
            "heldout_tokens": sum(len(c) for c in chunks),
            "perplexity_bf16_tables": bf16_ppl,
            "perplexity_int8_tables": int8_ppl,
            "int8_over_bf16_perplexity": int8_ppl / bf16_ppl,
            "host_bytes_int8_over_bf16": engine.store.nbytes / store.nbytes,
        }
    result["table_bytes_kept_off_the_device"] = store.nbytes  # what resident tables would occupy there
    result["torch_threads"] = torch.get_num_threads()
    print(json.dumps(result, indent=2))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
