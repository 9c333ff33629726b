"""Which layers to convert: evenly spaced (what "1/3" and "1/2" resolve to) against the layers that cost least when
converted alone. Converts every layer but 0 of SmolLM2-135M once (`fitted` with the `plain` `W_down` refit: each layer's
rows and refit depend only on dense activations, so any subset of them is that subset's own conversion; the default
`all` refit depends on which layers are converted), scores each layer alone on
calibration-side text held apart from the calibration tokens, then scores both choices on the held-out text.

Usage: python benchmarks/bench_layer_choice.py [--calibration-tokens 50000] [--out FILE]
"""

import argparse
import json
import time

import torch

from stem_hf import StemForCausalLM
from stem_hf.assets import corpora, smollm2_gguf
from stem_hf.conversion import convert, load_source
from stem_hf.conversion.report import perplexity
from stem_hf.conversion.sources import copy_dense_weights, stem_config_from_dense
from stem_hf.conversion.text import chunk_texts


def subset(dense, full, layers: list[int]) -> StemForCausalLM:
    """The conversion of `layers` alone, taken from `full` (a conversion of every layer)."""
    model = StemForCausalLM(stem_config_from_dense(dense.config, sorted(layers), "bfloat16")).eval()
    copy_dense_weights(dense, model)
    with torch.no_grad():
        for layer in layers:
            model.model.stem_tables[str(layer)].weight.copy_(full.model.stem_tables[str(layer)].weight)
            model.model.layers[layer].mlp.down_proj.weight.copy_(full.model.layers[layer].mlp.down_proj.weight)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration-tokens", type=int, default=50_000)
    parser.add_argument("--heldout-tokens", type=int, default=10_000)
    parser.add_argument("--out", default="benchmarks/results/bench_layer_choice.json")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    start = time.perf_counter()
    dense, tokenizer = load_source(smollm2_gguf())
    texts = corpora()
    bos = dense.config.bos_token_id
    calibration = chunk_texts(texts["calibration"], tokenizer, bos, 512, None)
    used = next(i for i in range(len(calibration)) if sum(map(len, calibration[: i + 1])) >= args.calibration_tokens)
    selection = calibration[used + 1 : used + 9]  # 8 chunks after the calibration tokens: chooses without the test set
    heldout = chunk_texts(texts["heldout"], tokenizer, bos, 512, args.heldout_tokens)
    every = list(range(1, dense.config.num_hidden_layers))
    full, _ = convert(
        dense,
        stem_layers=every,
        init="fitted",
        refit="plain",
        calibration=texts["calibration"],
        calibration_tokens=args.calibration_tokens,
        tokenizer=tokenizer,
    )
    dense_selection, dense_heldout = perplexity(dense, selection), perplexity(dense, heldout)
    alone = {layer: perplexity(subset(dense, full, [layer]), selection) / dense_selection for layer in every}
    print(json.dumps({"single_layer_cost": alone}), flush=True)
    cheapest = sorted(every, key=alone.get)
    result = {"calibration_tokens": args.calibration_tokens, "single_layer_cost": alone, "choices": []}
    for ratio in ("1/3", "1/2"):
        even = stem_config_from_dense(dense.config, ratio, "bfloat16").stem_layers
        for name, layers in (("evenly spaced", even), ("cheapest alone", sorted(cheapest[: len(even)]))):
            ratio_over_dense = perplexity(subset(dense, full, layers), heldout) / dense_heldout
            result["choices"].append({"ratio": ratio, "choice": name, "layers": layers, "over_dense": ratio_over_dense})
            print(json.dumps(result["choices"][-1]), flush=True)
    result["wall_time_s"] = time.perf_counter() - start
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
