"""Tables stay in host memory when the dense part goes to an accelerator. No GPU here: the device-map logic is checked
with transformers' own expansion of the map, and the load and forward paths run with device maps on CPU."""

import torch
from transformers.integrations.accelerate import expand_device_map

from stem_hf import StemForCausalLM, storage_stem
from stem_hf.storage_stem import StemTableRows, device_map_keeping_tables_on_cpu
from tests.conftest import tiny_model

TABLE, DENSE = "model.stem_tables.1.weight", "model.layers.1.mlp.gate_proj.weight"


def _placement(device_map: dict) -> dict:
    return expand_device_map(device_map, [TABLE, DENSE, "lm_head.weight", "model.rotary_emb.inv_freq"])


def test_single_device_maps_leave_tables_out():
    config = tiny_model().config
    for device_map in ("cuda:0", 0, torch.device("cuda", 0), {"": "cuda:0"}, {"model": 0, "lm_head": 0}):
        result = device_map_keeping_tables_on_cpu(StemForCausalLM, config, device_map, None)
        assert not any(k == "" or "stem_tables" in k or k == "model" for k in result), result
        placement = _placement(result)
        assert placement[TABLE] == "cpu"  # unmapped parameters load on CPU, with no accelerate hook
        assert str(placement[DENSE]) in ("cuda:0", "0") and str(placement["lm_head.weight"]) in ("cuda:0", "0")
        assert str(placement["model.rotary_emb.inv_freq"]) in ("cuda:0", "0")


def test_explicit_table_entries_are_dropped_and_split_maps_kept():
    config = tiny_model().config
    device_map = {
        "model.embed_tokens": 0,
        "model.layers.0": 0,
        "model.layers.1": 0,
        "model.layers.2": 1,
        "model.layers.3": 1,
        "model.norm": 1,
        "model.rotary_emb": 0,
        "model.stem_tables": 1,
        "lm_head": 1,
    }
    result = device_map_keeping_tables_on_cpu(StemForCausalLM, config, device_map, None)
    assert result == {k: v for k, v in device_map.items() if k != "model.stem_tables"}
    assert _placement(result)[TABLE] == "cpu"


def test_the_map_is_rewritten_only_when_tables_stay_on_cpu(tmp_path, monkeypatch):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    calls = []
    rewrite = device_map_keeping_tables_on_cpu
    monkeypatch.setattr(
        storage_stem,
        "device_map_keeping_tables_on_cpu",
        lambda cls, *args: calls.append(args[1]) or rewrite(cls, *args),
    )
    StemForCausalLM.from_pretrained(tmp_path, device_map={"": "cpu"})
    assert calls == [{"": "cpu"}]
    # The caller's override of the saved config is what decides, as it is what the loaded model gets.
    reloaded = StemForCausalLM.from_pretrained(tmp_path, device_map={"": "cpu"}, keep_tables_on_cpu=False)
    assert calls == [{"": "cpu"}] and reloaded.config.keep_tables_on_cpu is False


def test_auto_map_is_sized_in_the_load_dtype():
    config = tiny_model(vocab_size=4096).config
    dense_params = sum(p.numel() for n, p in tiny_model(vocab_size=4096).named_parameters() if "stem_tables" not in n)
    budget = {"cpu": int(dense_params * 2 * 1.3)}  # fits in bf16, not in fp32
    bf16 = device_map_keeping_tables_on_cpu(StemForCausalLM, config, "auto", budget, torch.bfloat16)
    fp32 = device_map_keeping_tables_on_cpu(StemForCausalLM, config, "auto", budget, torch.float32)
    assert "disk" not in bf16.values() and "disk" in fp32.values()


def test_rows_of_a_table_on_another_device_take_the_deduplicating_path(monkeypatch):
    model = tiny_model()
    seen = []
    monkeypatch.setattr(StemTableRows, "gather_unique", lambda self, table, ids: seen.append(ids.device.type))
    StemTableRows(model.model.stem_tables, torch.zeros(1, 3, dtype=torch.long, device="meta"))[1]
    StemTableRows(model.model.stem_tables, torch.zeros(1, 3, dtype=torch.long))[1]
    assert seen == ["meta"]  # ids elsewhere than the table: deduplicate; same device: plain lookup


def test_device_map_load_keeps_tables_mapped_and_logits_equal(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    input_ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        expected = model(input_ids).logits
    for device_map in ("auto", "cpu", {"": "cpu"}):
        reloaded = StemForCausalLM.from_pretrained(tmp_path, device_map=device_map)
        table = reloaded.model.stem_tables["1"].weight
        assert table.device.type == "cpu" and table.dtype == torch.bfloat16
        with torch.no_grad():
            assert torch.equal(reloaded(input_ids).logits, expected)
        out = reloaded.generate(input_ids, max_new_tokens=3, do_sample=False)
        assert out.shape == (2, 10)
