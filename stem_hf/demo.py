"""`stem-hf demo`, the end-to-end examples, in one place.

`run_demo` is `make demo`: converts the embedded SmolLM2-135M to STEM-1/3 (fitted tables, output projections refit
along the residual stream and the STEM layers' gates trained on the way, a short healing), saves it with table shards,
loads it back through `trust_remote_code`, and compares it with the dense model. `run_tiny_demo` is `stem-hf demo
--tiny`: builds a random tiny STEM model, shows what STEM costs next to dense at the paper's 1B shape, saves it with its
code, and loads it back as a user without this package would (trust_remote_code, in a fresh interpreter)."""

import json
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from .accounting import summarize
from .assets import CORPUS_NAMES, corpora, smollm2_gguf
from .checkpoint_stem import SAFE_WEIGHTS_INDEX_NAME, TABLE_KEY
from .configuration_stem import StemConfig
from .conversion.convert import run_conversion
from .conversion.plan import ConversionPlan
from .conversion.sources import Source, load_source
from .conversion.text import ConversionText
from .modeling_stem import StemForCausalLM
from .remote_check import load_without_package
from .system import format_bytes

__all__ = ["DEMO_SHAPE", "PAPER_1B", "PROMPTS", "SMOLLM2_HUB_ID", "run_demo", "run_tiny_demo"]

SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the embedded GGUF quantizes
PROMPTS = ("Once upon a time, there was a little", "The capital of France is", "To be, or not to be,")

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


def _continue(model: torch.nn.Module, tokenizer: object, prompt: str, bos: int | None, new_tokens: int = 16) -> str:
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    if bos is not None:  # converted tables keep an exact row for the BOS token at position 0
        ids = torch.cat([torch.tensor([[bos]]), ids], dim=1)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).replace("\n", " ")


def run_demo(
    out: str = "runs/demo",
    source: str | None = None,
    calibration_tokens: int = 50_000,
    heal_tokens: int = 20_000,
    heal_precision: str = "auto",
) -> dict:
    """Converts `source` (default: the embedded SmolLM2-135M GGUF) to STEM-1/3 in `out`, loads it back with and without
    this package, prints how it compares with the dense model, and returns the report with the load facts."""
    torch.set_flush_denormal(True)  # dequantized GGUF weights hold denormals, which CPUs multiply slowly
    provenance = {} if source else {"base_model": SMOLLM2_HUB_ID, "license": "apache-2.0"}
    source = source or smollm2_gguf()
    dense, tokenizer = load_source(source)
    checkpoint = os.path.join(out, "stem-1-3")
    # The STEM layers' gates train locally, the dense layers do not: a demo that runs in minutes on a laptop CPU.
    plan = ConversionPlan(
        stem_layers="1/3",
        init="fitted",
        dense_epochs=0,
        heal_tokens=heal_tokens,
        heal_options={"precision": heal_precision},
    )
    texts = corpora()
    text = ConversionText(
        calibration=texts["calibration"],
        calibration_tokens=calibration_tokens,
        heldout=texts["heldout"],
        heldout_tokens=10_000,
        calibration_name=CORPUS_NAMES["calibration"],
        heldout_name=CORPUS_NAMES["heldout"],
    )
    named = Source(dense, tokenizer, name=source, **provenance)
    _, report = run_conversion(named, checkpoint, plan, text)
    stem, facts = _reload(checkpoint, tokenizer)
    summary = {**report, **facts}
    _print(summary, source, checkpoint, dense.num_parameters())
    for prompt in PROMPTS:
        print(f"\n  {prompt!r}\n    dense: {_continue(dense, tokenizer, prompt, stem.config.bos_token_id)}")
        print(f"    STEM:  {_continue(stem, tokenizer, prompt, stem.config.bos_token_id)}")
    print(json.dumps(summary, indent=2))
    return summary


def _reload(checkpoint: str, tokenizer: object) -> tuple[torch.nn.Module, dict]:
    """Loads `checkpoint` through `trust_remote_code`, and with the copied code alone (no stem_hf): the model, and the
    load facts for the summary."""
    start = time.perf_counter()
    stem = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True)
    load_s = time.perf_counter() - start
    probe = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    remote = load_without_package(checkpoint, probe, max_new_tokens=1)
    with torch.no_grad():
        remote_diff = (remote["logits"] - stem(probe).logits).abs().max().item()
    table_bytes = sum(os.path.getsize(os.path.join(checkpoint, f)) for f in _table_files(checkpoint))
    return stem, {"load_s": load_s, "table_bytes": table_bytes, "remote_code_max_abs_diff": remote_diff}


def _table_files(checkpoint: str) -> list[str]:
    """The files the checkpoint's index puts table weights in."""
    with open(os.path.join(checkpoint, SAFE_WEIGHTS_INDEX_NAME)) as f:
        weight_map = json.load(f)["weight_map"]
    return sorted({file for name, file in weight_map.items() if TABLE_KEY.search(name)})


def _print(summary: dict, source: str, checkpoint: str, dense_params: int) -> None:
    print(f"\nSTEM-1/3 of {os.path.basename(source)}: layers {summary['stem_layers']}")
    print(
        f"  params: {summary['total_params'] / 1e6:.0f}M total, {summary['active_params_per_token'] / 1e6:.0f}M "
        f"active per token (dense: {dense_params / 1e6:.0f}M)"
    )
    print(
        f"  tables: {format_bytes(summary['table_bytes'])} in {len(_table_files(checkpoint))} files; load with "
        f"trust_remote_code: {summary['load_s']:.1f} s; copied code without stem_hf: max |diff| "
        f"{summary['remote_code_max_abs_diff']:.1e}"
    )
    print(f"  calibration: {summary['calibration_tokens']} tokens, {summary['vocab_coverage']:.1%} of the vocabulary")
    print(
        f"  held-out perplexity ({summary['heldout_tokens']} tokens): dense {summary['heldout_perplexity_dense']:.1f}"
    )
    if summary["heal_tokens"]:
        print(
            f"    STEM before healing {summary['heldout_perplexity_stem_before_healing']:.1f} "
            f"({summary['perplexity_ratio_before_healing']:.2f}x), after {summary['heal_tokens']} healing tokens "
            f"{summary['heldout_perplexity_stem']:.1f} ({summary['perplexity_ratio']:.2f}x; "
            f"{summary['heal_precision']}, {summary['heal_wall_time_s']:.0f} s)"
        )
    else:
        print(f"    STEM, no healing: {summary['heldout_perplexity_stem']:.1f} ({summary['perplexity_ratio']:.2f}x)")


def run_tiny_demo(out_dir: str | Path = "runs/demo") -> dict:
    """`stem-hf demo --tiny`: the paper-1B counts, then a random tiny STEM model saved to `out_dir` and loaded back
    without this package; returns its summary and the largest logit difference."""
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
