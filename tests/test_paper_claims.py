"""The paper-claims benchmark's parts at tiny size: the ablation variants and the MoE baselines (Mixtral's top-2 and the
hash-routed one) at matched active parameters, the spike rule, the measures, the paper protocol, and end-to-end runs of
every part with its cache, tables and PNGs."""

import json
import math
from dataclasses import replace

import pytest
import torch
from transformers import MixtralForCausalLM

from stem_hf.lab.claims import (
    Probes,
    TokenBlocks,
    expert_load,
    loss_by_position,
    loss_spikes,
    train_model,
    training_flops,
)
from stem_hf.lab.claims_run import (
    QUICK_CLAIMS,
    RunCache,
    diverged,
    flops_to_reach,
    paper_protocol,
    roi,
    run_claims,
)
from stem_hf.lab.train import LabSettings, lab_configs
from stem_hf.lab.variants import (
    ABLATIONS,
    StemAddedTableMLP,
    StemDownTableMLP,
    StemGateTableMLP,
    active_parameters,
    build_hash_moe,
    build_variant,
    hash_routes,
    moe_config,
    variant_config,
)
from stem_hf.modeling_stem import StemForCausalLM, StemTableMLP
from tests.conftest import benchmark_script

VOCAB = 300
SETTINGS = LabSettings(steps=4, batch_size=4, context=16, warmup=0.0, lr=1e-2)


@pytest.fixture(scope="module")
def configs():
    return lab_configs(SETTINGS, VOCAB)


def _blocks(n: int = 8, seed: int = 0) -> torch.Tensor:
    """Counting sequences from random starts: a pattern a few steps of training begin to learn."""
    starts = torch.randint(0, 40, (n, 1), generator=torch.Generator().manual_seed(seed))
    return (starts + torch.arange(SETTINGS.context)) % 40 + 3


def _models(configs) -> dict:
    models = {"dense": StemForCausalLM(configs["dense"]), "MoE": MixtralForCausalLM(moe_config(configs["dense"]))}
    for where in ABLATIONS:
        torch.manual_seed(0)
        models[where] = build_variant(variant_config(configs["STEM-full"], configs["dense"], where), where)
    return models


def test_active_parameters_counted_by_hand(configs):
    d, layers, vocab = 64, 4, VOCAB  # the lab's shape: 4 heads of 16, 2 KV heads, tied embeddings
    attention, norms = d * d * 2 + d * 32 * 2, 2 * d
    dense = vocab * d + layers * (attention + norms + 3 * d * 256) + d
    moe = vocab * d + layers * (attention + norms + d * 8 + 2 * 3 * d * 128) + d  # router, then 2 of 8 experts
    assert active_parameters(StemForCausalLM(configs["dense"])) == dense
    assert active_parameters(MixtralForCausalLM(moe_config(configs["dense"]))) == moe


@pytest.mark.slow
def test_variants_and_moe_match_dense_active_parameters_and_train(configs, tmp_path):
    dense = active_parameters(StemForCausalLM(configs["dense"]))
    valid = {"v": _blocks(4, seed=1)}
    for name, model in _models(configs).items():
        assert abs(active_parameters(model) / dense - 1) <= 0.02, name
        result = train_model(model, TokenBlocks(_blocks()), SETTINGS, tmp_path / name, Probes([], valid, 2))
        assert len(result["train_loss"]) == SETTINGS.steps and len(result["monitor_loss"]) == SETTINGS.steps, name
        assert all(math.isfinite(v) for v in result["train_loss"]), name
        assert [p["step"] for p in result["probes"]] == [0, 2, 4], name
        assert result["probes"][-1]["loss"]["v"] < result["probes"][0]["loss"]["v"], name  # it learns


@pytest.mark.slow
def test_variants_put_the_table_where_they_say(configs):
    """Each variant's STEM layers hold its FFN, read the token's row, and the gradient reaches only the batch's rows."""
    kinds = {"up": StemTableMLP, "gate": StemGateTableMLP, "added": StemAddedTableMLP, "down": StemDownTableMLP}
    ids = torch.tensor([[5, 6, 7, 5]])
    for where, kind in kinds.items():
        model = build_variant(variant_config(configs["STEM-full"], configs["dense"], where), where)
        stem = [layer.mlp for i, layer in enumerate(model.model.layers) if i in model.config.stem_layers]
        assert stem and all(type(m) is kind for m in stem), where
        assert type(model.model.layers[0].mlp) is not kind  # layer 0 stays dense in STEM-full
        model(input_ids=ids, labels=ids).loss.backward()
        table = model.model.stem_tables[str(model.config.stem_layers[0])].weight
        touched = table.grad.abs().sum(-1).nonzero().flatten().tolist()
        assert touched == [5, 6, 7], where


def test_variant_formulas():
    config = replace(lab_configs(SETTINGS, VOCAB)["STEM-full"], intermediate_size=100)
    silu = torch.nn.functional.silu
    x, rows = torch.randn(2, 3, config.hidden_size), torch.randn(2, 3, 100)
    down = StemDownTableMLP(config)
    h = silu(down.gate_proj(x)) * down.up_proj(x) * rows
    expected = torch.nn.functional.pad(h, (0, 2 * config.hidden_size - 100)).view(2, 3, 2, -1).sum(-2)
    torch.testing.assert_close(down(x, rows), expected)
    gate = StemGateTableMLP(config)
    torch.testing.assert_close(gate(x, rows), gate.down_proj(silu(rows) * gate.up_proj(x)))
    added = StemAddedTableMLP(config)
    torch.testing.assert_close(added(x, rows), added.down_proj(silu(added.gate_proj(x)) * (added.up_proj(x) + rows)))
    with pytest.raises(ValueError, match="unknown place"):
        build_variant(config, "embedding")


def test_moe_baseline_is_transformers_mixtral_with_its_balancing_loss(configs):
    model = MixtralForCausalLM(moe_config(configs["dense"]))
    assert type(model).__module__ == "transformers.models.mixtral.modeling_mixtral"
    ids = _blocks(2)
    out = model(input_ids=ids, labels=ids)
    ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert out.aux_loss > 0
    torch.testing.assert_close(out.loss, ce + model.config.router_aux_loss_coef * out.aux_loss)
    load = expert_load(model, ids)
    for shares in load["shares"]:
        assert sum(shares) == pytest.approx(1.0)
    with torch.no_grad():  # a router that scores every expert alike: its top 2 take every token
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()
    load = expert_load(model, ids)
    assert load["max_over_mean"] == [4.0] * 4 and load["idle_experts"] == [6] * 4
    # by hand, at the mean context 8 of a 16-token block: attention, the two chosen experts (the dense FFN's
    # multiply-adds), the head, and the router's 8 scores per layer; training is 3x the forward
    attention, ffn, head, router = 2 * 64 * 64 + 2 * 64 * 32 + 2 * 64 * 8, 3 * 64 * 256, 64 * VOCAB, 64 * 8
    assert training_flops(model, 16) == 3 * 2 * (4 * (attention + ffn + router) + head)
    assert training_flops(StemForCausalLM(configs["STEM-full"]), 16) > 0


def test_spike_rule_flags_a_spike_not_a_smooth_noisy_curve():
    g = torch.Generator().manual_seed(0)
    steps = torch.arange(300, dtype=torch.float)
    smooth = (1.2 + 5 * torch.exp(-steps / 40)) * (1 + 0.02 * torch.randn(300, generator=g))
    assert loss_spikes(smooth.tolist()) == []
    spiked = smooth.clone()
    spiked[200] *= 1.5
    spiked[250:253] = spiked[249] * 2
    assert loss_spikes(spiked.tolist()) == [200, 250, 251, 252]
    assert loss_spikes([3.0, 2.0, float("nan"), 1.0]) == [2]
    assert loss_spikes(torch.linspace(8, 1, 100).tolist()) == []  # falling fast is not a spike


def test_loss_by_position_buckets():
    losses = torch.arange(1, 64, dtype=torch.float).repeat(2, 1)  # the loss of position p is p
    buckets = loss_by_position(losses, (1, 8, 32, 128))
    assert list(buckets) == ["1-8", "8-32", "32-64"]
    assert buckets["1-8"] == pytest.approx(4.0) and buckets["32-64"] == pytest.approx(47.5)


def _run(flops: int, points: list[tuple[int, float, float]]) -> dict:
    probes = [{"tokens": t, "recall": r, "loss": {"text": v}} for t, r, v in points]
    return {"train_flops_per_token": flops, "probes": probes, "final_recall": probes[-1]["recall"],
            "final_loss": probes[-1]["loss"]}  # fmt: skip


def test_flops_to_reach_and_roi_on_known_curves():
    run = _run(10, [(0, 0.0, 7.0), (100, 0.2, 5.0), (200, 0.6, 3.0)])
    assert flops_to_reach(run, 0.4) == pytest.approx(1500)
    assert flops_to_reach(run, 0.1) == pytest.approx(500)
    assert flops_to_reach(run, 0.9) is None
    assert flops_to_reach(run, 4.0, "text") == pytest.approx(1500)
    dense = _run(10, [(0, 0.0, 7.0), (100, 0.25, 5.0), (200, 0.5, 4.0)])
    stem = _run(8, [(0, 0.0, 7.0), (100, 0.5, 4.0), (200, 0.6, 3.5)])  # reaches dense's end in half the tokens
    settings = replace(QUICK_CLAIMS, seeds=(0,), lrs=(1e-3,))
    result = roi({("dense", 1e-3, 0): dense, ("STEM-1/2", 1e-3, 0): stem, ("STEM-full", 1e-3, 0): dense}, settings)
    half = result["STEM-1/2"]
    assert half["flops_ratio"]["mean"] == pytest.approx(0.8)
    assert half["roi"]["mean"] == pytest.approx((0.6 / 8) / (0.5 / 10))
    assert half["dense_flops_over_stem_to_recall_0.5"]["mean"] == pytest.approx(2000 / 800)
    assert half["dense_flops_over_stem_to_dense_final_text_loss"]["mean"] == pytest.approx(2000 / 800)
    assert result["STEM-full"]["roi"]["mean"] == pytest.approx(1.0)


def test_diverged_and_run_cache(tmp_path):
    assert not diverged(_run(1, [(0, 0, 7.0), (1, 0, 3.0), (2, 0, 3.5)]))
    assert diverged(_run(1, [(0, 0, 7.0), (1, 0, 3.0), (2, 0, 4.0)]))  # ended above 1.2x its best
    assert diverged(_run(1, [(0, 0, 7.0), (1, 0, float("nan"))]))
    cache, calls = RunCache(tmp_path), []
    train = lambda: calls.append(1) or {"x": len(calls)}  # noqa: E731
    assert cache.get("a b", {"lr": 1}, train)["x"] == 1
    assert cache.get("a b", {"lr": 1}, train)["x"] == 1 and len(calls) == 1  # same settings: reused
    assert cache.get("a b", {"lr": 2}, train)["x"] == 2  # other settings: trained again
    assert cache.get("c", {"lr": 1}, train)["x"] == 3


@pytest.mark.slow
def test_claims_run_end_to_end_resumes_and_reports(tmp_path):
    from stem_hf.assets import corpora
    from stem_hf.lab.claims_plots import markdown, plot_claims

    settings = replace(QUICK_CLAIMS, lab=replace(QUICK_CLAIMS.lab, steps=4), probe_every=2)
    texts = {split: pieces[:100] for split, pieces in corpora().items()}  # real text, a slice of it: quicker
    result = run_claims(settings, tmp_path, texts)
    assert set(result["stability"]) == {"0.003", "0.03"}
    assert result["stability"]["0.003"]["dense"]["final_recall"]["n"] == 2  # every seed at the lab's rate
    assert result["stability"]["0.03"]["MoE"]["final_text_loss"]["n"] == 1
    assert "expert_max_over_mean" in result["stability"]["0.03"]["MoE"]
    assert set(result["roi"]) == {"STEM-1/2", "STEM-full"}
    assert set(result["ablations"]) == {"dense", "STEM-full", "table at the gate", "table added to the up",
                                        "table at the down"}  # fmt: skip
    lc = result["long_context"]
    assert set(lc["models"]) == {"dense", "STEM-full"} and "1-8" in lc["dense_minus_stem_by_position"]
    assert list(lc["activated"]) == ["8", "16", "32", "64"]
    cached = sorted((tmp_path / "runs").glob("*.json"))
    assert len(cached) == 4 * 3 + 3 + 2
    again = run_claims(settings, tmp_path, texts, ("stability",))  # every run from the cache: nothing retrains
    assert json.dumps(again["stability"]) == json.dumps(result["stability"])
    assert sorted((tmp_path / "runs").glob("*.json")) == cached
    table = markdown(json.loads(json.dumps(result)))
    assert "| 0.03 | MoE | 1 |" in table and "table at the down" in table
    assert [p.name for p in plot_claims(result, tmp_path / "png")] == [
        "stability.png", "roi.png", "expert_load.png", "ablations.png", "long_context.png"
    ]  # fmt: skip


def test_saved_result_keeps_curves_apart():
    """The JSON the docs quote holds no per-step curve (a curve value could pass for a misquoted figure); the curves
    file gives the plots back all of them."""
    script = benchmark_script("paper_claims")
    run = {"train_loss": [1.0] * 10, "grad_norm": [None] * 10, "monitor_loss": [2.0] * 10, "spike_losses": [],
           "probes": [{"step": 0}], "spikes": [], "intermediate_size": 8}  # fmt: skip
    copy = lambda: json.loads(json.dumps(run))  # noqa: E731
    result = {"runs": {"a": copy()}, "long_context": {"models": {"b": copy()}}}
    result = script.compact(result, every=5)
    assert result["runs"]["a"]["train_loss"] == [1.0, 1.0] and result["runs"]["a"]["curve_every"] == 5
    summary, curves = script.split(json.loads(json.dumps(result)))
    for kept in (summary["runs"]["a"], summary["long_context"]["models"]["b"]):
        assert not set(script.CURVES) & set(kept) and kept["intermediate_size"] == 8
    assert script.merge(summary, curves) == result


def test_hash_routes_are_fixed_distinct_and_balanced_over_the_vocabulary():
    routes = hash_routes(1001, num_experts=16, top_k=4, seed=3)
    assert torch.equal(routes, hash_routes(1001, 16, 4, seed=3)) and not torch.equal(
        routes, hash_routes(1001, 16, 4, 4)
    )
    assert all(len(set(row)) == 4 for row in routes.tolist())  # a token's experts are distinct
    for j in range(4):  # slot j picks among experts 4j..4j+3, each by 250 or 251 of the 1001 ids
        counts = torch.bincount(routes[:, j], minlength=16)
        assert counts[4 * j : 4 * j + 4].tolist() in ([251, 250, 250, 250], [250, 251, 250, 250],
                                                       [250, 250, 251, 250], [250, 250, 250, 251])  # fmt: skip
        assert counts.sum() == counts[4 * j : 4 * j + 4].sum()
    with pytest.raises(ValueError, match="do not split into top_k=3"):
        hash_routes(10, 16, 3, 0)


def test_hash_moe_sums_the_hashed_experts_at_dense_active_parameters(configs):
    torch.manual_seed(0)
    model = build_hash_moe(configs["dense"], num_experts=8, top_k=2)
    dense = StemForCausalLM(configs["dense"])
    assert active_parameters(model) == active_parameters(dense)
    assert training_flops(model, 16) == training_flops(dense, 16)
    assert model.model.stem_tables["0"].weight.numel() == 0  # routes come through the row source, not tables
    mlp, x = model.model.layers[2].mlp, torch.randn(1, 3, 64)
    ids = torch.tensor([[5, 77, 5]])
    w, silu = mlp.width, torch.nn.functional.silu

    def expert(e: int, h: torch.Tensor) -> torch.Tensor:
        units = slice(e * w, (e + 1) * w)
        return mlp.down_proj.weight[:, units] @ (
            silu(mlp.gate_proj.weight[units] @ h) * (mlp.up_proj.weight[units] @ h)
        )

    by_hand = [sum(expert(e, h) for e in mlp.routes[t].tolist()) for t, h in zip(ids[0].tolist(), x[0], strict=True)]
    out = mlp(x, ids)
    assert torch.allclose(out[0], torch.stack(by_hand), atol=1e-6)
    out.sum().backward()
    used = set(mlp.routes[ids[0]].flatten().tolist())
    for e in range(mlp.num_experts):  # an expert no token picked gets no gradient
        assert bool(mlp.gate_proj.weight.grad[e * w : (e + 1) * w].abs().sum() > 0) == (e in used)
    logits = model(input_ids=_blocks(2)).logits
    assert logits.shape == (2, SETTINGS.context, VOCAB) and torch.isfinite(logits).all()


def test_paper_protocol_keeps_dense_shape_and_the_reference_recipe():
    paper = paper_protocol(QUICK_CLAIMS)
    assert paper.lab.recipe == "paper" and paper.headline[-1] == "hash MoE" and paper.other_lr_seeds == 1
    with pytest.raises(ValueError, match="protocol 'matched' trains with recipe 'stem-hf', not 'paper'"):
        replace(QUICK_CLAIMS, lab=replace(QUICK_CLAIMS.lab, recipe="paper"))
    with pytest.raises(ValueError, match="protocol: 'same' is not one of matched, paper"):
        replace(QUICK_CLAIMS, protocol="same")
    with pytest.raises(ValueError, match="stability part"):
        run_claims(paper, "unused", {}, ("ablations",))


@pytest.mark.slow
def test_paper_protocol_end_to_end(tmp_path):
    from stem_hf.assets import corpora
    from stem_hf.lab.claims_plots import markdown, plot_claims

    settings = paper_protocol(replace(QUICK_CLAIMS, lab=replace(QUICK_CLAIMS.lab, steps=4), probe_every=2))
    texts = {split: pieces[:100] for split, pieces in corpora().items()}
    result = run_claims(settings, tmp_path, texts)
    assert set(result) >= {"stability", "roi"} and "ablations" not in result
    rows = result["stability"]["0.003"]
    assert list(rows) == ["dense", "STEM-1/2", "STEM-full", "MoE", "hash MoE"]
    assert "expert_max_over_mean" in rows["hash MoE"] and rows["hash MoE"]["final_recall"]["n"] == 2
    assert rows["hash MoE"]["active_params_per_token"] == rows["dense"]["active_params_per_token"]
    assert rows["STEM-full"]["active_params_per_token"] < rows["dense"]["active_params_per_token"]  # same shape
    assert result["roi"]["STEM-full"]["flops_ratio"]["mean"] < result["roi"]["STEM-1/2"]["flops_ratio"]["mean"] < 1
    sizes = {r["intermediate_size"] for key, r in result["runs"].items() if not key.startswith(("MoE", "hash"))}
    assert sizes == {QUICK_CLAIMS.lab.intermediate_size}
    assert "| 0.03 | hash MoE | 1 |" in markdown(json.loads(json.dumps(result)))
    assert [p.name for p in plot_claims(result, tmp_path / "png")] == ["stability.png", "roi.png", "expert_load.png"]
