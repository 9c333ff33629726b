"""`make demo`: converts the embedded SmolLM2-135M to STEM-1/3 (fitted tables, output projections refit along the
residual stream and the STEM layers' gates trained on the way, a short healing), saves it with table shards, loads it
back through `trust_remote_code`, and compares it with the dense model."""

import json
import os
import time

import torch
from transformers import AutoModelForCausalLM

from .. import write_model_card
from ..assets import CORPUS_NAMES, corpora, smollm2_gguf
from ..remote_check import load_without_package
from ..storage_stem import REPORT_FILE
from .convert import convert
from .sources import load_source

SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the embedded GGUF quantizes
PROMPTS = ("Once upon a time, there was a little", "The capital of France is", "To be, or not to be,")


def _continue(model, tokenizer, prompt: str, bos: int | None, new_tokens: int = 16) -> str:
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
    torch.set_flush_denormal(True)  # dequantized GGUF weights hold denormals: 4-5x slower CPU matmuls without this
    provenance = {} if source else {"base_model": SMOLLM2_HUB_ID, "license": "apache-2.0"}
    source = source or smollm2_gguf()
    texts = corpora()
    dense, tokenizer = load_source(source)
    checkpoint = os.path.join(out, "stem-1-3")
    _, report = convert(
        dense,
        checkpoint,
        stem_layers="1/3",
        init="fitted",
        calibration=texts["calibration"],
        calibration_tokens=calibration_tokens,
        heldout=texts["heldout"],
        heldout_tokens=10_000,
        tokenizer=tokenizer,
        dense_epochs=0,  # the STEM layers' gates train locally, the dense layers do not: 15 minutes on 2 cores
        heal_tokens=heal_tokens,
        heal_options={"precision": heal_precision},
        calibration_name=CORPUS_NAMES["calibration"],
        heldout_name=CORPUS_NAMES["heldout"],
        **provenance,
    )
    report["source"] = source  # the model was passed loaded: name the file it came from
    path = os.path.join(checkpoint, REPORT_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=2)
    os.replace(path + ".tmp", path)
    write_model_card(checkpoint)

    start = time.perf_counter()
    stem = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True)
    load_s = time.perf_counter() - start
    probe = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    remote = load_without_package(checkpoint, probe, max_new_tokens=1)
    with torch.no_grad():
        remote_diff = (remote["logits"] - stem(probe).logits).abs().max().item()
    table_bytes = sum(
        os.path.getsize(os.path.join(checkpoint, f)) for f in os.listdir(checkpoint) if f.startswith("stem-tables-")
    )

    print(f"\nSTEM-1/3 of {os.path.basename(source)}: layers {report['stem_layers']}")
    print(
        f"  params: {report['total_params'] / 1e6:.0f}M total, {report['active_params_per_token'] / 1e6:.0f}M active "
        f"per token (dense: {dense.num_parameters() / 1e6:.0f}M)"
    )
    print(
        f"  tables: {table_bytes / 1e9:.2f} GB in {len([f for f in os.listdir(checkpoint) if 'stem-tables' in f])} "
        f"files; load with trust_remote_code: {load_s:.1f} s; copied code without stem_hf: max |diff| {remote_diff:.1e}"
    )
    print(f"  calibration: {report['calibration_tokens']} tokens, {report['vocab_coverage']:.1%} of the vocabulary")
    dense_ppl = report["heldout_perplexity_dense"]
    print(f"  held-out perplexity ({report['heldout_tokens']} tokens): dense {dense_ppl:.1f}")
    if heal_tokens:
        print(
            f"    STEM before healing {report['heldout_perplexity_stem_before_healing']:.1f} "
            f"({report['perplexity_ratio_before_healing']:.2f}x), after {report['heal_tokens']} healing tokens "
            f"{report['heldout_perplexity_stem']:.1f} ({report['perplexity_ratio']:.2f}x; {report['heal_precision']}, "
            f"{report['heal_wall_time_s']:.0f} s)"
        )
    else:
        print(f"    STEM, no healing: {report['heldout_perplexity_stem']:.1f} ({report['perplexity_ratio']:.2f}x)")
    bos = stem.config.bos_token_id
    for prompt in PROMPTS:
        print(f"\n  {prompt!r}\n    dense: {_continue(dense, tokenizer, prompt, bos)}")
        print(f"    STEM:  {_continue(stem, tokenizer, prompt, bos)}")
    summary = {**report, "load_s": load_s, "table_bytes": table_bytes, "remote_code_max_abs_diff": remote_diff}
    print(json.dumps(summary, indent=2))
    return summary
