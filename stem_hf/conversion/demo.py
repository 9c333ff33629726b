"""`make demo`: converts the embedded SmolLM2-135M to STEM-1/3 (fitted tables, output projections refit along the
residual stream and the STEM layers' gates trained on the way, a short healing), saves it with table shards, loads it
back through `trust_remote_code`, and compares it with the dense model."""

import json
import os
import time

import torch
from transformers import AutoModelForCausalLM

from ..accounting import format_bytes
from ..assets import CORPUS_NAMES, corpora, smollm2_gguf
from ..checkpoint_stem import SAFE_WEIGHTS_INDEX_NAME, TABLE_KEY
from ..remote_check import load_without_package
from .convert import run_conversion
from .plan import ConversionPlan
from .sources import Source, load_source
from .text import ConversionText

__all__ = ["PROMPTS", "SMOLLM2_HUB_ID", "run_demo"]

SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the embedded GGUF quantizes
PROMPTS = ("Once upon a time, there was a little", "The capital of France is", "To be, or not to be,")


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
