"""`stem-hf demo`: the small end-to-end example. Builds a STEM model, shows what it costs next to dense, saves it with
its code, and loads it back as a user without this package would (trust_remote_code, in a fresh interpreter)."""

import json
import time
from pathlib import Path

import torch

from .accounting import summarize
from .configuration_stem import StemConfig
from .modeling_stem import StemForCausalLM
from .remote_check import load_without_package

# Llama-3.2-1B's shape with an untied head: the paper's 1B model.
PAPER_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
)
DEMO_SHAPE = dict(
    vocab_size=4096,
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def run_demo(out_dir: str | Path = "runs/demo") -> dict:
    out_dir = Path(out_dir)
    print("STEM at the paper's 1B shape (meta device, no memory used):")
    print(f"{'stem_layers':>12} {'total':>8} {'tables':>8} {'active':>8} {'dense':>8} {'FLOPs/dense @2048':>18}")
    for ratio in ("1/3", "1/2", "full"):
        s = summarize(StemConfig(**PAPER_1B, stem_layers=ratio))
        print(
            f"{ratio:>12} {s['total_params'] / 1e9:7.2f}B {s['table_params'] / 1e9:7.2f}B "
            f"{s['active_params_per_token'] / 1e9:7.2f}B {s['dense_params'] / 1e9:7.2f}B "
            f"{s['flops_ratio_stem_over_dense']:18.3f}"
        )

    torch.manual_seed(0)
    config = StemConfig(**DEMO_SHAPE, stem_layers="1/2")
    model = StemForCausalLM(config).eval()
    checkpoint = out_dir / "stem-tiny"
    model.save_pretrained(checkpoint)
    print(f"\nsaved a random-init STEM model (stem_layers={config.stem_layers}) to {checkpoint}:")
    for path in sorted(checkpoint.iterdir()):
        print(f"  {path.name:40s} {path.stat().st_size / 1e6:8.2f} MB")

    input_ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    remote = load_without_package(checkpoint, input_ids, max_new_tokens=8)
    with torch.no_grad():
        expected = model(input_ids).logits
    diff = (remote["logits"] - expected).abs().max().item()
    print(
        f"\nloaded back with trust_remote_code in a fresh interpreter without stem_hf ({remote['module']}) "
        f"in {time.perf_counter() - start:.1f}s: max |logit diff| = {diff:.1e}"
    )
    print(f"greedy continuation of row 0: {remote['generated'][0, 16:].tolist()}")
    if diff != 0.0:
        raise SystemExit("the copied code does not reproduce the model's logits")

    result = {"checkpoint": str(checkpoint), "max_abs_logit_diff": diff, **summarize(config, context_length=256)}
    print(json.dumps(result, indent=2))
    return result
