"""Dense -> STEM conversion on tiny random models built with transformers' own classes."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from stem_hf import StemForCausalLM
from stem_hf.conversion import convert, stem_config_from_dense
from tests.conftest import SHAPE, SOURCES, _cli_source, _dense, _texts, _word_tokenizer


@pytest.mark.parametrize("kind", list(SOURCES))
@pytest.mark.parametrize("tied", [False, True])
def test_no_stem_layers_reproduces_the_source(kind, tied, tmp_path):
    dense = _dense(kind, tied)
    dense.save_pretrained(tmp_path / "src")
    stem, _ = convert(str(tmp_path / "src"), tmp_path / "out", stem_layers="")
    input_ids = torch.randint(0, SHAPE["vocab_size"], (2, 11))
    reloaded = StemForCausalLM.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        expected = dense(input_ids).logits
        assert (stem(input_ids).logits - expected).abs().max().item() < 1e-4
        assert (reloaded(input_ids).logits - expected).abs().max().item() < 1e-4


def test_unsupported_architecture_is_refused_with_the_supported_list():
    with pytest.raises(
        ValueError,
        match="cannot convert GPT2LMHeadModel: supported source architectures are "
        "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
    ):
        stem_config_from_dense(GPT2Config(architectures=["GPT2LMHeadModel"]), "1/3")


@pytest.mark.parametrize(
    ("config", "feature"),
    [
        (MistralConfig(**SHAPE, sliding_window=16), "sliding-window attention"),
        (Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=16, max_window_layers=0), "sliding-window"),
        (LlamaConfig(**SHAPE, hidden_act="gelu"), "'gelu' gate"),
    ],
)
def test_features_stem_lacks_are_refused_by_name(config, feature):
    with pytest.raises(ValueError, match=f"uses .*{feature}.*which STEM does not implement"):
        stem_config_from_dense(config, "1/3")


def test_a_window_longer_than_the_context_is_no_window():
    config = stem_config_from_dense(MistralConfig(**SHAPE, sliding_window=128), "1/2")
    assert config.stem_layers == [1, 3]


@pytest.mark.parametrize("init", ["projected", "mean", "fitted"])
def test_rows_are_what_each_init_promises(init):
    dense = _dense("llama")
    calibration = _texts(6, 200, seed=1)
    stem, report = convert(
        dense, stem_layers=[2], init=init, calibration=calibration, table_dtype="float32", chunk_len=50, shrink=0.0
    )
    layer, table = dense.model.layers[2], stem.model.stem_tables["2"].weight
    embed = dense.model.embed_tokens.weight
    if init == "projected":
        expected = layer.mlp.up_proj(layer.post_attention_layernorm(embed))
        assert torch.allclose(table, expected, atol=1e-5)
        return
    # Reference statistics by hand: the FFN inputs of layer 2 at every position but 0 of each 50-token chunk.
    inputs = []
    handle = layer.mlp.register_forward_pre_hook(lambda m, a: inputs.append(a[0][0]))
    chunks = [torch.tensor([1, *text[i : i + 49]]) for text in calibration for i in range(0, 200, 49)]
    chunks = [c for c in chunks if len(c) >= 3]
    with torch.no_grad():
        for chunk in chunks:
            dense(chunk[None])
    handle.remove()
    x = torch.cat([h[1:] for h in inputs])
    ids = torch.cat([c[1:] for c in chunks])
    token = int(ids.mode().values)
    xs = x[ids == token]
    with torch.no_grad():
        if init == "mean":
            expected = layer.mlp.up_proj(xs.mean(0))
        else:
            w = F.silu(layer.mlp.gate_proj(xs)).pow(2)
            expected = (w * layer.mlp.up_proj(xs)).sum(0) / w.sum(0)
        assert torch.allclose(table[token], expected, atol=1e-4)
        # The BOS row is the exact position-0 row: position 0 of the converted model is the dense model's.
        probe = torch.tensor([[1, 5, 9, 13]])
        assert torch.allclose(stem(probe).logits[0, 0], dense(probe).logits[0, 0], atol=1e-4)
    assert report["calibration_tokens"] == sum(len(c) for c in chunks)
    assert report["distinct_tokens"] == len(ids.unique())


def test_calibrated_inits_need_calibration_text():
    with pytest.raises(ValueError, match="init 'fitted' needs calibration text"):
        convert(_dense("llama"), stem_layers=[1], init="fitted")
    with pytest.raises(ValueError, match="init: 'best' is not one of fitted, mean, projected, xavier"):
        convert(_dense("llama"), stem_layers=[1], init="best")


def test_report_and_saved_checkpoint(tmp_path):
    dense = _dense("qwen3")
    stem, report = convert(
        dense,
        tmp_path,
        stem_layers="1/2",
        init="fitted",
        calibration=_texts(4, 120, seed=2),
        heldout=_texts(2, 120, seed=3),
        chunk_len=60,
    )
    saved = json.loads((tmp_path / "conversion_report.json").read_text())
    assert saved == json.loads(json.dumps(report))
    for key in (
        "source",
        "source_architecture",
        "stem_layers",
        "init",
        "refit",
        "gate_epochs",
        "dense_epochs",
        "calibration_tokens",
        "distinct_tokens",
        "vocab_coverage",
        "heldout_tokens",
        "heldout_perplexity_dense",
        "heldout_perplexity_stem",
        "perplexity_ratio",
        "wall_time_s",
        "total_params",
        "active_params_per_token",
    ):
        assert key in saved, key
    assert saved["source_architecture"] == "Qwen3ForCausalLM" and saved["stem_layers"] == [1, 3]
    assert (saved["refit"], saved["gate_epochs"], saved["dense_epochs"]) == ("all", 5, 5)
    assert 0 < saved["vocab_coverage"] <= 1 and saved["heldout_perplexity_stem"] > 1
    reloaded = StemForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config.qk_norm and reloaded.model.stem_tables["1"].weight.dtype == torch.bfloat16
    probe = torch.tensor([[1, 7, 8, 9]])
    with torch.no_grad():
        assert torch.allclose(reloaded(probe).logits, stem(probe).logits)


def test_cli_converts_a_folder_with_text_files_and_carries_the_tokenizer(tmp_path, capsys):
    from stem_hf.cli import main

    _cli_source(tmp_path)
    main(
        [
            "convert",
            str(tmp_path / "src"),
            str(tmp_path / "out"),
            "--stem-layers",
            "1,3",
            "--init",
            "mean",
            "--prior-context",
            "w3 w4",
            "--calibration",
            str(tmp_path / "calib.txt"),
            "--heldout",
            str(tmp_path / "held.txt"),
            "--calibration-tokens",
            "300",
            "--table-dtype",
            "fp32",
            "--heal-tokens",
            "200",
            "--heal-train",
            "tables",
            "--heal-precision",
            "bf16",
            "--device",
            "cpu",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert report["stem_layers"] == [1, 3] and report["init"] == "mean" and report["prior_context"] == "w3 w4"
    assert report["heal_tokens"] == 200 and report["heal_train"] == "tables" and report["heal_lr"] is None
    assert report["heal_precision"] == "bf16"
    assert report["calibration_tokens"] == 300 and report["heldout_tokens"] == 401  # capped; BOS + 400 words
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "out" / "conversion_report.json").read_text())["init"] == "mean"
    reloaded = StemForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.model.stem_tables["3"].weight.dtype == torch.float32


@pytest.mark.parametrize(
    "options, expected",
    [
        ([], " the"),
        (["--init", "mean"], " the"),
        (["--no-prior-context"], None),
        (["--init", "projected"], None),
        (["--init", "xavier"], None),
        (["--stem-layers", ""], None),
    ],
)
def test_cli_defaults_to_the_prior_context_for_calibrated_inits(tmp_path, capsys, options, expected):
    from stem_hf.cli import main
    from stem_hf.conversion.options import PRIOR_CONTEXT

    assert PRIOR_CONTEXT == " the"
    _cli_source(tmp_path)
    files = ["--calibration", str(tmp_path / "calib.txt"), "--heldout", str(tmp_path / "held.txt")]
    main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--stem-layers", "1", *files, *options])
    assert json.loads(capsys.readouterr().out)["prior_context"] == expected


def test_cli_refuses_a_prior_context_and_its_opt_out_together(capsys):
    from stem_hf.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["convert", "a", "b", "--prior-context", " the", "--no-prior-context"])
    assert exit.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_cli_refuses_an_unsupported_source(tmp_path):
    from transformers import GPT2LMHeadModel

    from stem_hf.cli import main

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="cannot convert GPT2LMHeadModel"):
        main(["convert", str(tmp_path / "gpt2"), str(tmp_path / "out"), "--calibration", "--heldout"])
    assert not (tmp_path / "out").exists()


def test_qwen2_sliding_window_on_no_layer_is_accepted():
    config = Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=16, max_window_layers=28)
    assert stem_config_from_dense(config, "1/2").stem_layers == [1, 3]


def test_a_source_without_bos_converts_with_finite_tables():
    dense = Qwen2ForCausalLM(Qwen2Config(**{**SHAPE, "bos_token_id": None})).eval()
    stem, report = convert(dense, stem_layers=[1, 2], init="fitted", calibration=_texts(3, 100, seed=4), chunk_len=40)
    assert report["bos_prepended"] is False and report["distinct_tokens"] > 0
    assert all(torch.isfinite(t.weight).all() for t in stem.model.stem_tables.values())


def test_text_without_a_tokenizer_or_tokens_is_a_clear_error():
    with pytest.raises(ValueError, match="strings but the source has no tokenizer"):
        convert(_dense("llama"), stem_layers=[1], init="mean", calibration=["some text"])
    with pytest.raises(ValueError, match="holds no token past position 0"):
        convert(_dense("llama"), stem_layers=[1], init="mean", calibration=_texts(2, 50, 5), calibration_tokens=1)


def _ffn_inputs(dense, layer: int, chunks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The FFN inputs of `layer` at every position of `chunks`, and the input token at each."""
    inputs = []
    handle = dense.model.layers[layer].mlp.register_forward_pre_hook(lambda m, a: inputs.append(a[0][0]))
    with torch.no_grad():
        for chunk in chunks:
            dense(chunk[None])
    handle.remove()
    return torch.cat(inputs), torch.cat(chunks)


def test_plain_refit_is_the_least_squares_down_projection():
    from stem_hf.conversion.refit import refit

    dense = _dense("llama")
    chunks = [torch.tensor([1, *t]) for t in _texts(8, 40, seed=6)]
    stem, report = convert(dense, stem_layers=[2], init="mean", calibration=chunks, table_dtype="float32")
    assert report["refit"] == "none"
    before = stem.model.layers[2].mlp.down_proj.weight.detach().clone()
    refit(dense, stem, chunks, "plain", ridge=0.0)
    x, ids = _ffn_inputs(dense, 2, chunks)
    mlp, table = dense.model.layers[2].mlp, stem.model.stem_tables["2"].weight
    with torch.no_grad():
        h = F.silu(mlp.gate_proj(x)) * table[ids]
        target = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        expected = torch.linalg.lstsq(h.double(), target.double()).solution.T.float()
        refit = stem.model.layers[2].mlp.down_proj.weight
        assert torch.allclose(refit, expected, atol=1e-3), (refit - expected).abs().max()
        assert (h @ refit.T - target).pow(2).sum() < (h @ before.T - target).pow(2).sum()


def test_fitted_refits_down_and_lowers_the_layer_error():
    dense = _dense("llama")
    chunks = [torch.tensor([1, *t]) for t in _texts(8, 60, seed=8)]
    errors = {}
    for refit in ("none", "plain"):
        stem, report = convert(dense, stem_layers=[1], init="fitted", calibration=chunks, refit=refit)
        assert report["refit"] == refit
        x, ids = _ffn_inputs(dense, 1, chunks)
        with torch.no_grad():
            mlp = dense.model.layers[1].mlp
            stem_out = stem.model.layers[1].mlp(x, stem.model.stem_tables["1"].weight[ids])
            errors[refit] = (stem_out - mlp(x)).pow(2).sum().item()
    assert errors["plain"] < errors["none"], errors


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama-mlp-bias"])
def test_sequential_refit_of_one_layer_is_the_plain_one(kind):
    """The first STEM layer sees the dense model's inputs either way, and the residual the dense layer adds is its FFN
    output: the sequential refit changes nothing until a second STEM layer."""
    if kind == "llama-mlp-bias":  # the down projection's bias is in the dense layer output, not in the refit target
        torch.manual_seed(0)
        dense = LlamaForCausalLM(LlamaConfig(**SHAPE, mlp_bias=True)).eval()
        with torch.no_grad():
            for layer in dense.model.layers:
                layer.mlp.down_proj.bias.normal_(0.0, 0.5)
    else:
        dense = _dense(kind)
    chunks = [torch.tensor([1, *t]) for t in _texts(6, 50, seed=9)]
    models = [
        convert(
            dense, stem_layers=[2], init="fitted", calibration=chunks, table_dtype="float32", refit=r, gate_epochs=0
        )[0]
        for r in ("plain", "sequential")
    ]
    plain, sequential = (m.state_dict() for m in models)
    for name, value in plain.items():
        torch.testing.assert_close(sequential[name], value, rtol=1e-4, atol=1e-5, msg=name)


def _streams(model, chunk: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Per decoder layer on `chunk`: its input, the residual after attention, its output, and what its `o_proj` and
    `down_proj` multiply."""
    got = {name: [] for name in ("input", "after_attention", "output", "heads", "features")}
    handles = []
    for block in model.model.layers:
        handles += [
            block.register_forward_pre_hook(lambda m, a: got["input"].append(a[0][0])),
            block.post_attention_layernorm.register_forward_pre_hook(
                lambda m, a: got["after_attention"].append(a[0][0])
            ),
            block.register_forward_hook(lambda m, a, out: got["output"].append(out[0])),
            block.self_attn.o_proj.register_forward_pre_hook(lambda m, a: got["heads"].append(a[0][0])),
            block.mlp.down_proj.register_forward_pre_hook(lambda m, a: got["features"].append(a[0][0])),
        ]
    try:
        with torch.no_grad():
            model(chunk[None])
    finally:
        for handle in handles:
            handle.remove()
    return got


@pytest.mark.parametrize(("kind", "epochs"), [(kind, 0) for kind in SOURCES] + [("llama", 20)])
def test_refit_along_the_stream_is_the_least_squares_fit_of_each_layer(kind, epochs):
    """With no ridge, every refit projection leaves a residual orthogonal to its inputs as the converted model computes
    them: each layer is solved on the inputs the layers before it, already refit, give it (so the pass's own stepping
    through the layers matches the model's forward, for each source architecture). With local training, `W_down` is
    solved last, on the gates as trained (or kept, when training did not lower the layer's loss)."""
    from stem_hf.conversion.refit import refit

    dense = _dense(kind)  # llama has attention biases: o_proj has a bias the refit keeps
    if epochs:
        with torch.no_grad():  # FFNs a token row stands in for badly: local training has something to learn
            for name, param in dense.named_parameters():
                if name.endswith("proj.weight"):
                    param.normal_(0.0, 0.3)
    chunks = [torch.tensor([1, *t]) for t in _texts(10, 60, seed=10)]
    stem, _ = convert(dense, stem_layers=[1, 3], init="fitted", calibration=chunks, table_dtype="float32", refit="none")
    trained = refit(dense, stem, chunks, "all", ridge=0.0, gate_epochs=epochs, dense_epochs=epochs)
    assert bool(trained) == (epochs > 0), trained
    runs = [(_streams(stem, c), _streams(dense, c)) for c in chunks]
    for layer in range(1, SHAPE["num_hidden_layers"]):
        block = stem.model.layers[layer]
        pairs = {"down_proj": ("features", "after_attention", "output", block.mlp.down_proj)}
        if layer > 1:
            pairs["o_proj"] = ("heads", "input", "after_attention", block.self_attn.o_proj)
        for name, (feature, base, goal, linear) in pairs.items():
            features = torch.cat([s[feature][layer] for s, _ in runs])
            residual = torch.cat([d[goal][layer] - s[base][layer] - linear(s[feature][layer]) for s, d in runs])
            gradient = (features.T @ residual).norm() / (features.norm() * residual.norm())
            assert gradient < 1e-3, (layer, name, gradient.item())


def test_refits_bring_the_residual_stream_closer_to_dense():
    dense = _dense("llama")
    chunks = [torch.tensor([1, *t]) for t in _texts(8, 60, seed=10)]
    errors = {}
    for refit in ("plain", "sequential", "all"):
        stem, report = convert(
            dense,
            stem_layers=[1, 3],
            init="fitted",
            calibration=chunks,
            table_dtype="float32",
            refit=refit,
            gate_epochs=0,
            dense_epochs=0,
        )
        assert report["refit"] == refit
        runs = [(_streams(stem, c), _streams(dense, c)) for c in chunks]
        errors[refit] = sum((s["output"][-1] - d["output"][-1]).pow(2).sum().item() for s, d in runs)
    assert errors["sequential"] < 0.9 * errors["plain"], errors
    assert errors["all"] < 0.9 * errors["sequential"], errors


def test_local_training_brings_the_residual_stream_closer_to_dense():
    """Training the gates (and the dense layers' gate and up) along the stream lowers the error the refit leaves, on the
    calibration text and on other text."""
    dense = _dense("llama")
    with (
        torch.no_grad()
    ):  # FFNs far from what a token-indexed row can stand in for, so that there is something to learn
        for name, param in dense.named_parameters():
            if name.endswith("proj.weight"):
                param.normal_(0.0, 0.3)
    chunks = [torch.tensor([1, *t]) for t in _texts(32, 60, seed=10)]
    other = [torch.tensor([1, *t]) for t in _texts(4, 60, seed=11)]
    errors = {}
    for epochs in ((0, 0), (20, 0), (20, 20)):
        stem, report = convert(
            dense,
            stem_layers=[1, 3],
            init="fitted",
            calibration=chunks,
            table_dtype="float32",
            gate_epochs=epochs[0],
            dense_epochs=epochs[1],
        )
        assert (report["gate_epochs"], report["dense_epochs"]) == epochs
        # trained where asked (and kept where it lowered the layer's loss): the STEM layers' gates, the dense layer
        # after the first STEM layer's gate and up; never layer 0
        candidates = [(layer, "gate_proj") for layer in range(4)] + [(0, "up_proj"), (2, "up_proj")]
        trained = {
            (layer, name)
            for layer, name in candidates
            if not torch.equal(*(getattr(m.model.layers[layer].mlp, name).weight for m in (stem, dense)))
        }
        assert set(report["locally_trained_layers"]) == {layer for layer, _ in trained}
        assert bool({(1, "gate_proj"), (3, "gate_proj")} & trained) == (epochs[0] > 0)
        assert ({(2, "gate_proj"), (2, "up_proj")} <= trained) == (epochs[1] > 0) and (0, "gate_proj") not in trained
        for name, text in (("calibration", chunks), ("other", other)):
            runs = [(_streams(stem, c), _streams(dense, c)) for c in text]
            errors[name, epochs] = sum((s["output"][-1] - d["output"][-1]).pow(2).sum().item() for s, d in runs)
    for name in ("calibration", "other"):
        assert errors[name, (20, 0)] < errors[name, (0, 0)] and errors[name, (20, 20)] < errors[name, (20, 0)], errors


def test_train_gate_lowers_its_loss_and_leaves_down_alone():
    from stem_hf.conversion.refit import train_gate

    torch.manual_seed(0)
    mlp = _dense("llama").model.layers[1].mlp
    x, rows = torch.randn(200, 32), torch.randn(200, 48)
    with torch.no_grad():  # what another gate would give: within reach of training
        other = mlp.gate_proj.weight + 0.5 * torch.randn_like(mlp.gate_proj.weight) * mlp.gate_proj.weight.std()
        target = mlp.down_proj(F.silu(x @ other.T) * rows)
    down = mlp.down_proj.weight.clone()

    def loss():
        with torch.no_grad():
            return (mlp.down_proj(F.silu(mlp.gate_proj(x)) * rows) - target).pow(2).mean().item()

    before = loss()
    with torch.inference_mode():  # as the refit calls it
        kept = train_gate(mlp, x, rows.bfloat16(), target, epochs=30)  # rows in a table's dtype
    assert kept and loss() < 0.8 * before and torch.equal(mlp.down_proj.weight, down)
    # Training that makes the loss worse (far too large steps) is not kept.
    gate = mlp.gate_proj.weight.clone()
    with torch.inference_mode():
        assert not train_gate(mlp, x, rows, target, epochs=3, lr=100.0)
    assert torch.equal(mlp.gate_proj.weight, gate)
    # Nor training that cannot help (the gate already gives the target).
    gate = mlp.gate_proj.weight.clone()
    with torch.no_grad():
        exact = mlp.down_proj(F.silu(mlp.gate_proj(x)) * rows)
    with torch.inference_mode():
        assert not train_gate(mlp, x, rows, exact, epochs=3)
    assert torch.equal(mlp.gate_proj.weight, gate)


def test_local_training_needs_the_refit_along_the_stream():
    dense, chunks = _dense("llama"), [torch.tensor([1, *t]) for t in _texts(2, 30, seed=1)]
    with pytest.raises(ValueError, match="gate_epochs: local training .*refit 'sequential' or 'all'.*'plain'"):
        convert(dense, stem_layers=[1], calibration=chunks, refit="plain", gate_epochs=2)
    with pytest.raises(ValueError, match="dense_epochs: local training .*refit 'all'.*'sequential'"):
        convert(dense, stem_layers=[1], calibration=chunks, refit="sequential", dense_epochs=2)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=f"gate_epochs: {bad!r} is not a whole number of epochs"):
            convert(dense, stem_layers=[1], calibration=chunks, gate_epochs=bad)
    _, report = convert(dense, stem_layers=[1], init="mean", calibration=chunks)
    assert (report["refit"], report["gate_epochs"], report["dense_epochs"]) == ("none", 0, 0)


def test_refit_needs_calibration_text_and_a_known_name():
    with pytest.raises(ValueError, match="refit 'sequential' needs calibration text"):
        convert(_dense("llama"), stem_layers=[1], init="projected", refit="sequential")
    with pytest.raises(ValueError, match="refit: 'feedback' is not one of none, plain, sequential, all"):
        convert(_dense("llama"), stem_layers=[1], init="projected", refit="feedback")


def test_context_inputs_are_the_ffn_inputs_after_the_prefix():
    from stem_hf.conversion.calibrate import context_inputs

    dense = _dense("qwen3")
    got = context_inputs(dense, [1, 2], [1, 7, 9], SHAPE["vocab_size"], positions=96)  # batches of 24: 64 split
    seen, handles = {}, []
    for layer in (1, 2):
        hook = lambda _m, args, layer=layer: seen.__setitem__(layer, args[0][:, -1])  # noqa: E731
        handles.append(dense.model.layers[layer].mlp.register_forward_pre_hook(hook))
    with torch.no_grad():
        dense(torch.tensor([[1, 7, 9, t] for t in range(SHAPE["vocab_size"])]))
    for handle in handles:
        handle.remove()
    for layer in (1, 2):
        assert torch.allclose(got[layer], seen[layer], atol=1e-5)


def test_prior_context_moves_only_the_rows_that_lean_on_the_fallback():
    dense, calibration = _dense("llama"), _texts(6, 200, seed=1)
    options = dict(stem_layers=[1, 2], init="fitted", calibration=calibration, table_dtype="float32", chunk_len=50)
    tokenizer = _word_tokenizer()
    plain, _ = convert(dense, refit="none", **options)
    context, report = convert(dense, refit="none", prior_context="w5 w9", tokenizer=tokenizer, **options)
    assert report["prior_context"] == "w5 w9"
    seen = torch.zeros(SHAPE["vocab_size"], dtype=torch.bool)
    seen[torch.tensor([t for text in calibration for t in text])] = True
    seen[SHAPE["bos_token_id"]] = True  # the exact position-0 row
    for layer in ("1", "2"):
        a, b = plain.model.stem_tables[layer].weight, context.model.stem_tables[layer].weight
        assert not torch.allclose(a[~seen], b[~seen], atol=1e-3)  # unseen tokens: the fallback itself
        assert not torch.allclose(a[seen], b[seen], atol=1e-3)  # seen ones: shrunk toward it
        assert torch.isfinite(b).all()
    # No shrinkage: a seen token's row is its calibration statistics alone, whatever the fallback.
    plain, _ = convert(dense, refit="none", shrink=0.0, **options)
    context, _ = convert(dense, refit="none", shrink=0.0, prior_context="w5", tokenizer=tokenizer, **options)
    seen[SHAPE["bos_token_id"]] = False
    for layer in ("1", "2"):
        a, b = plain.model.stem_tables[layer].weight, context.model.stem_tables[layer].weight
        assert torch.allclose(a[seen], b[seen], atol=1e-5)


def test_prior_context_needs_a_tokenizer_and_a_calibrated_init():
    calibration = _texts(2, 100, seed=1)
    with pytest.raises(ValueError, match="prior_context: a text needs the source's tokenizer"):
        convert(_dense("llama"), stem_layers=[1], calibration=calibration, prior_context=" the")
    with pytest.raises(ValueError, match="prior_context: init 'projected' has no fallback rows"):
        convert(_dense("llama"), stem_layers=[1], init="projected", prior_context=" the", tokenizer=_word_tokenizer())
