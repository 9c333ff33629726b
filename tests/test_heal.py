"""Healing: the annealed blend, distillation, the compact table rows, and healing inside `convert`."""

import json

import pytest
import torch
from torch.nn.utils import parametrize
from transformers import LlamaConfig, LlamaForCausalLM

from stem_hf.conversion import convert
from stem_hf.conversion.blend import BlendedStem, StemBlendMLP
from stem_hf.conversion.heal import distillation_loss, heal
from stem_hf.modeling_stem import StemTableMLP
from tests.conftest import SHAPE, _converted, _opinionated, _texts


def _kl(dense, stem, chunks) -> float:
    with torch.no_grad():
        return sum(distillation_loss(stem(c[None]).logits, dense(c[None]).logits).item() for c in chunks) / len(chunks)


def test_the_blend_at_one_is_the_dense_model_and_at_zero_the_stem_model():
    dense, stem = _converted()
    ids = torch.randint(0, 64, (2, 17))
    with torch.no_grad():
        stem_logits = stem(ids).logits
        with BlendedStem(dense, stem, torch.tensor([1, 5, 9])) as blend:  # other rows: read from the tables
            assert all(isinstance(stem.model.layers[i].mlp, StemBlendMLP) for i in (1, 2))
            # the default refit changed o_proj after the first STEM layer and the dense layer 3's FFN: blended too (the
            # STEM layers' trained gates are StemBlendMLP's)
            blended = {name for name, m in stem.named_modules() if parametrize.is_parametrized(m, "weight")}
            ffn = ("3.mlp.gate_proj", "3.mlp.up_proj", "3.mlp.down_proj")
            assert blended == {f"model.layers.{n}" for n in ("2.self_attn.o_proj", "3.self_attn.o_proj", *ffn)}
            assert not torch.equal(
                stem.model.layers[1].mlp.gate_proj.weight, dense.model.layers[1].mlp.gate_proj.weight
            )
            blend.set_blend(1.0)
            assert (stem(ids).logits - dense(ids).logits).abs().max() < 1e-5
            blend.set_blend(0.0)
            assert torch.equal(stem(ids).logits, stem_logits)
            blend.set_blend(0.5)
            halfway = stem(ids).logits
            assert not torch.allclose(halfway, stem_logits) and not torch.allclose(halfway, dense(ids).logits)
    # Restored: STEM layers without W_up, the original table modules.
    assert all(isinstance(stem.model.layers[i].mlp, StemTableMLP) for i in (1, 2))
    assert not any("up_proj" in k for k in stem.state_dict() if k.startswith(("model.layers.1.", "model.layers.2.")))
    assert not any("parametrizations" in k for k in stem.state_dict())
    with torch.no_grad():
        assert torch.equal(stem(ids).logits, stem_logits)


def test_the_blend_at_one_is_dense_also_with_trained_ffn_biases():
    """Local training changes the dense layers' gate and up biases too (a source with MLP biases): blended as well."""
    torch.manual_seed(0)
    dense = LlamaForCausalLM(LlamaConfig(**SHAPE, mlp_bias=True)).eval()
    with torch.no_grad():
        for name, param in dense.named_parameters():
            if name.endswith("proj.weight"):
                param.normal_(0.0, 0.3)
            elif name.endswith("proj.bias"):
                param.normal_(0.0, 0.1)
    stem, report = convert(
        dense, stem_layers=[1, 2], calibration=_texts(12, 120, seed=1), chunk_len=60, table_dtype="float32"
    )
    assert 3 in report["locally_trained_layers"]
    assert not torch.equal(stem.model.layers[3].mlp.up_proj.bias, dense.model.layers[3].mlp.up_proj.bias)
    ids = torch.randint(0, 64, (2, 17))
    with torch.no_grad(), BlendedStem(dense, stem, torch.tensor([1, 5, 9])) as blend:
        blended = {
            (n, t) for n, m in stem.named_modules() for t in ("weight", "bias") if parametrize.is_parametrized(m, t)
        }
        assert {("model.layers.3.mlp.up_proj", "bias"), ("model.layers.3.mlp.gate_proj", "bias")} <= blended
        blend.set_blend(1.0)
        assert (stem(ids).logits - dense(ids).logits).abs().max() < 1e-5
    assert not any("parametrizations" in k for k in stem.state_dict())


@pytest.mark.parametrize(("train", "tied"), [("tables", False), ("ffn", False), ("all", False), ("all", True)])
def test_healing_brings_the_stem_model_closer_to_dense(train, tied):
    dense, stem = _converted(init="xavier", tied=tied)
    text = _texts(8, 120, seed=7)
    chunks = [torch.tensor([1, *t[:59]]) for t in text]
    stem.model.norm.weight.requires_grad_(False)  # a caller's frozen weight stays frozen, and untrained
    before = {n: p.detach().clone() for n, p in stem.named_parameters()}
    kl_before = _kl(dense, stem, chunks)
    seen = []
    info = heal(dense, stem, chunks, 3000, train=train, table_lr=3e-2, lr=1e-3, callback=lambda *a: seen.append(a))
    assert _kl(dense, stem, chunks) < 0.7 * kl_before
    assert info["heal_tokens"] == 3000 and info["heal_train"] == train
    assert info["heal_kl_last"] < info["heal_kl_before"]
    assert seen[-1][0] == 3000 and seen[-1][1] == 0.0 and 0 < seen[0][1] < 1  # tokens seen, blend, KL
    changed = {n for n, p in stem.named_parameters() if not torch.equal(p, before[n])}
    assert {"model.stem_tables.1.weight", "model.stem_tables.2.weight"} <= changed
    ffn = {f"model.layers.{i}.mlp.{m}.weight" for i in (1, 2) for m in ("gate_proj", "down_proj")}
    if train == "tables":
        assert changed == {"model.stem_tables.1.weight", "model.stem_tables.2.weight"}
    elif train == "ffn":
        assert changed - {"model.stem_tables.1.weight", "model.stem_tables.2.weight"} == ffn
    else:
        assert {"model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"} | ffn <= changed
        assert "model.norm.weight" not in changed
    assert not stem.model.norm.weight.requires_grad
    assert all(p.requires_grad for n, p in stem.named_parameters() if n != "model.norm.weight")
    assert all(p.requires_grad for p in dense.parameters()) and not dense.training
    assert tied == (stem.lm_head.weight is stem.model.embed_tokens.weight)


def test_bf16_healing_trains_fp32_weights_under_autocast():
    dense, stem = _converted(init="xavier")
    chunks = [torch.tensor([1, *t[:59]]) for t in _texts(8, 120, seed=7)]
    kl_before = _kl(dense, stem, chunks)
    dtypes, rows = {"dense": [], "stem": []}, []
    hooks = [  # the student's down_proj is shared with the blend that stands in for its STEM FFN
        model.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, a, out, k=key: dtypes[k].append(out.dtype))
        for key, model in (("dense", dense), ("stem", stem))
    ]

    def compact_rows(*args):  # inside healing: the tables are the compact trained copies
        rows.extend((t.weight.dtype, t.weight.grad) for t in stem.model.stem_tables.values())

    info = heal(dense, stem, chunks, 3000, table_lr=3e-2, lr=1e-3, precision="bf16", callback=compact_rows)
    for hook in hooks:
        hook.remove()
    # the last training steps (the KL before training is scored in fp32): teacher and student under autocast
    assert set(dtypes["dense"][-5:]) == set(dtypes["stem"][-5:]) == {torch.bfloat16}
    assert rows and all(dtype == torch.float32 and grad is None for dtype, grad in rows)  # fp32, gradients cleared
    assert info["heal_precision"] == "bf16"
    assert _kl(dense, stem, chunks) < 0.7 * kl_before  # scored in fp32 after healing
    assert all(p.dtype == torch.float32 for p in stem.parameters())  # master weights and tables stay fp32
    with torch.no_grad():
        assert stem(chunks[0][None]).logits.dtype == torch.float32


def test_auto_precision_resolves_to_what_the_device_computes_natively():
    from stem_hf.conversion.heal import resolve_precision

    dense, stem = _converted()
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert resolve_precision("auto", "cpu") == ("bf16" if native else "fp32")
    assert resolve_precision("auto", "meta") == "fp32" and resolve_precision("bf16", "meta") == "bf16"
    info = heal(dense, stem, [torch.tensor([1, 5, 6, 7] * 10)], tokens=80, precision="auto")
    assert info["heal_precision"] == resolve_precision("auto", "cpu")  # the report names what ran, never "auto"


def test_an_interrupted_healing_restores_the_stem_layers():
    dense, stem = _converted()

    def stop(*args):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        heal(dense, stem, [torch.tensor([1, 5, 6, 7] * 10)], tokens=400, log_every=1, callback=stop)
    assert all(isinstance(stem.model.layers[i].mlp, StemTableMLP) for i in (1, 2))
    assert all(type(t).__name__ == "StemTable" for t in stem.model.stem_tables.values())
    assert all(p.requires_grad for p in stem.parameters())


def test_only_rows_of_tokens_in_the_text_change():
    dense, stem = _converted()
    chunks = [torch.tensor([1, 5, 6, 7, 5, 8, 9] * 8)]
    table = stem.model.stem_tables["1"].weight
    before = table.detach().clone()
    info = heal(dense, stem, chunks, tokens=400, train="tables", table_lr=1e-2)
    assert info["heal_rows"] == 6
    touched = (table != before).any(dim=1).nonzero().flatten().tolist()
    assert touched == [1, 5, 6, 7, 8, 9]


def test_bad_token_caps_are_clear_errors():
    dense = _opinionated("llama")
    for name in ("calibration_tokens", "heldout_tokens"):
        with pytest.raises(ValueError, match=f"{name}: 0 must be at least 1"):
            convert(dense, stem_layers=[1], init="xavier", **{name: 0})


def test_bad_healing_options_are_clear_errors():
    dense, stem = _converted()
    chunks = [torch.tensor([1, 5, 6, 7])]
    with pytest.raises(ValueError, match="heal train: 'everything' is not one of tables, ffn, all"):
        heal(dense, stem, chunks, tokens=10, train="everything")
    with pytest.raises(ValueError, match=r"heal anneal: 1.5 is not a share of the healing steps in \[0, 1\]"):
        heal(dense, stem, chunks, tokens=10, anneal=1.5)
    with pytest.raises(ValueError, match="healing needs calibration text"):
        heal(dense, stem, [torch.tensor([1])], tokens=10)
    with pytest.raises(ValueError, match="heal tokens: 1 is not 0"):
        heal(dense, stem, chunks, tokens=1)
    with pytest.raises(ValueError, match=r"heal warmup: 2 is not a share"):
        heal(dense, stem, chunks, tokens=10, warmup=2)
    with pytest.raises(ValueError, match="heal log_every: 0"):
        heal(dense, stem, chunks, tokens=10, log_every=0)
    with pytest.raises(ValueError, match="heal precision: 'fp16' is not one of fp32, bf16, auto"):
        heal(dense, stem, chunks, tokens=10, precision="fp16")
    with pytest.raises(ValueError, match="table_lr 0 must be > 0"):
        heal(dense, stem, chunks, tokens=10, table_lr=0)
    with pytest.raises(ValueError, match="heal device: 'cuda:99' is not usable here"):  # before any calibration
        convert(dense, stem_layers=[1], init="fitted", calibration=chunks, heal_tokens=10, device="cuda:99")
    with pytest.raises(ValueError, match="no STEM layers"):
        heal(dense, convert(dense, stem_layers="")[0], chunks, tokens=10)
    with pytest.raises(ValueError, match="heal callback: 'print' is not callable"):  # before any calibration
        convert(
            dense,
            stem_layers=[1],
            init="fitted",
            calibration=chunks,
            heal_tokens=10,
            heal_options={"callback": "print"},
        )
    with pytest.raises(ValueError, match="none was given"):
        convert(dense, stem_layers=[1], init="xavier", heal_tokens=100)


def test_convert_with_healing_reports_before_and_after(tmp_path):
    from stem_hf.conversion.report import perplexity
    from stem_hf.conversion.text import chunk_texts

    dense = _opinionated("qwen2")
    heldout = _texts(2, 120, seed=3)
    curve = []
    stem, report = convert(
        dense,
        tmp_path,
        stem_layers=[1, 3],
        init="mean",
        calibration=_texts(6, 120, seed=2),
        heldout=heldout,
        chunk_len=60,
        heal_tokens=1200,
        heal_options={"log_every": 5, "callback": lambda tokens, a, kl: curve.append((tokens, a, kl))},
    )
    # heal_options reach heal(): the curve ends at the last step, on the pure STEM model (a = 0).
    assert curve and curve[-1][0] == 1200 and curve[-1][1] == 0.0
    saved = json.loads((tmp_path / "conversion_report.json").read_text())
    assert saved["heal_tokens"] == 1200 and saved["heal_train"] == "all"
    assert saved["heal_anneal"] == 0.0  # the default for a calibrated init (`mean`): its start beats the blend
    assert saved["heal_text"].endswith("(too short: followed by the calibration tokens again)")  # all text calibrated
    # The report's "after" is the returned (and saved) model's; "before" is what it was before healing.
    chunks = chunk_texts(heldout, None, 1, 60, None)
    assert saved["heldout_perplexity_stem"] == pytest.approx(perplexity(stem, chunks), rel=1e-6)
    assert saved["heldout_perplexity_stem"] != saved["heldout_perplexity_stem_before_healing"]
    assert saved["perplexity_ratio_before_healing"] == pytest.approx(
        saved["heldout_perplexity_stem_before_healing"] / saved["heldout_perplexity_dense"]
    )
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert not [k for k in index if k.startswith(("model.layers.1.mlp.up_proj", "model.layers.3.mlp.up_proj"))]


def test_healing_text_follows_the_calibration_tokens():
    from stem_hf.conversion.text import calibration_and_healing_chunks, chunk_texts

    texts = _texts(8, 120, seed=4)
    # the calibration ends inside a chunk, whose rest healing then skips
    calibration, heal_text = calibration_and_healing_chunks(texts, None, 1, 150, 300, 250)
    assert [c.tolist() for c in calibration] == [c.tolist() for c in chunk_texts(texts, None, 1, 150, 300)]
    assert sum(len(c) for c in calibration) == 300 and sum(len(c) for c in heal_text) >= 250
    following = chunk_texts(texts, None, 1, 150, None)[len(calibration) :]  # the budget cuts only the last short
    assert [c.tolist() for c in heal_text[:-1]] == [c.tolist() for c in following[: len(heal_text) - 1]]
    assert heal_text[-1].tolist() == following[len(heal_text) - 1][: len(heal_text[-1])].tolist()
    everything = chunk_texts(texts, None, 1, 60, None)
    for cap in (None, 10_000):  # nothing follows: heal() gets the calibration
        calibration, heal_text = calibration_and_healing_chunks(texts, None, 1, 60, cap, 100)
        assert [c.tolist() for c in calibration] == [c.tolist() for c in everything] and heal_text == []


def test_convert_heals_on_text_the_calibration_did_not_use():
    dense = _opinionated("llama")
    seen = []
    _, report = convert(
        dense,
        stem_layers=[1],
        init="fitted",
        calibration=_texts(10, 120, seed=5),
        calibration_tokens=400,
        chunk_len=60,
        heal_tokens=300,
        heal_options={"log_every": 1, "callback": lambda *a: seen.append(a)},
    )
    assert report["heal_text"] == "calibration text after the calibration tokens" and seen[-1][0] == 300
