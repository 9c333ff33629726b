"""The paper-claims benchmark's parts at tiny size: the ablation variants and the MoE baseline at matched active
parameters, the spike rule, the measures, and one end-to-end run of every part with its cache, tables and PNGs."""

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
    token_losses,
    train_model,
    training_flops,
)
from stem_hf.lab.claims_run import QUICK_CLAIMS, _flops_to_reach, run_claims
from stem_hf.lab.train import LabSettings, lab_configs
from stem_hf.lab.variants import (
    ABLATIONS,
    StemAddedTableMLP,
    StemDownTableMLP,
    StemGateTableMLP,
    active_parameters,
    build_variant,
    moe_config,
    variant_config,
)
from stem_hf.modeling_stem import StemForCausalLM, StemTableMLP

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


def test_variants_and_moe_match_dense_active_parameters_and_train(configs, tmp_path):
    dense = active_parameters(StemForCausalLM(configs["dense"]))
    valid = _blocks(4, seed=1)
    for name, model in _models(configs).items():
        assert abs(active_parameters(model) / dense - 1) <= 0.02, name
        before = token_losses(model, valid).mean().item()
        result = train_model(model, TokenBlocks(_blocks()), SETTINGS, tmp_path / name, Probes([], valid, 2))
        assert len(result["train_loss"]) == SETTINGS.steps and len(result["monitor_loss"]) == SETTINGS.steps, name
        assert all(math.isfinite(v) for v in result["train_loss"]), name
        assert result["final_valid_loss"] < before, name  # it learns
        assert [p["step"] for p in result["probes"]] == [2, 4], name


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


def test_down_variant_folds_any_width():
    config = replace(lab_configs(SETTINGS, VOCAB)["STEM-full"], intermediate_size=100)
    mlp = StemDownTableMLP(config)
    x, rows = torch.randn(2, 3, config.hidden_size), torch.randn(2, 3, 100)
    h = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x) * rows
    expected = torch.nn.functional.pad(h, (0, 2 * config.hidden_size - 100)).view(2, 3, 2, -1).sum(-2)
    torch.testing.assert_close(mlp(x, rows), expected)
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
    assert all(m >= 1.0 for m in load["max_over_mean"])
    assert training_flops(model, 16) is None
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


def test_flops_to_reach_interpolates():
    run = {"train_flops_per_token": 10, "probes": [{"tokens": 100, "recall": 0.2}, {"tokens": 200, "recall": 0.6}]}
    assert _flops_to_reach(run, 0.4) == pytest.approx(1500)
    assert _flops_to_reach(run, 0.1) == pytest.approx(500)
    assert _flops_to_reach(run, 0.9) is None


def test_claims_run_end_to_end_resumes_and_reports(tmp_path):
    from stem_hf.assets import corpora
    from stem_hf.lab.claims_plots import markdown, plot_claims

    settings = replace(QUICK_CLAIMS, lab=replace(QUICK_CLAIMS.lab, steps=4), probe_every=2)
    texts = {split: pieces[:100] for split, pieces in corpora().items()}  # real text, a slice of it: quicker
    result = run_claims(settings, tmp_path, texts)
    assert set(result["stability"]) == {"0.003", "0.03"}
    assert result["stability"]["0.003"]["dense"]["final_valid_loss"]["n"] == 2  # every seed at the lab's rate
    assert result["stability"]["0.03"]["MoE"]["final_valid_loss"]["n"] == 1
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
