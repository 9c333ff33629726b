import json

import pytest

from stem_hf import StemConfig, resolve_stem_layers
from tests.conftest import TINY, tiny_config, tiny_model


@pytest.mark.parametrize(
    ("spec", "layers", "expected"),
    [
        ("1/3", 16, [1, 4, 7, 10, 13]),  # the paper's 1B model
        ("1/2", 16, [1, 3, 5, 7, 9, 11, 13, 15]),
        ("full", 16, list(range(1, 16))),
        ("1/3", 30, [1, 4, 7, 10, 13, 16, 19, 22, 25, 28]),
        ("FULL", 3, [1, 2]),
        ("1/4", 9, [1, 5]),
        ("1/3", 1, []),
        ("7, 1,4", 8, [1, 4, 7]),
        ("", 8, []),
        ("none", 8, []),
        (None, 8, []),
        ([5, 0, 2], 8, [0, 2, 5]),
        ((), 8, []),
    ],
)
def test_resolve_stem_layers(spec, layers, expected):
    assert resolve_stem_layers(spec, layers) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("2/3", "unknown ratio '2/3'"),
        ("1/1", "unknown ratio '1/1'"),
        ("1/x", "unknown ratio"),
        ("half", "cannot read 'half'"),
        ([1, 8], "layer index 8 is out of range; allowed indices are 0..7"),
        ([-1], "layer index -1 is out of range"),
        ("1,3,3", "layer index 3 is listed more than once"),
        ([1.0], "non-integer"),
        ([True], "non-integer"),
    ],
)
def test_bad_stem_layers_name_field_and_allowed_values(spec, message):
    with pytest.raises(ValueError, match="stem_layers") as info:
        resolve_stem_layers(spec, 8)
    assert message in str(info.value)
    if "ratio" in message or "cannot read" in message:
        assert '"full"' in str(info.value) and '"1/3"' in str(info.value)


def test_config_stores_explicit_list_and_round_trips(tmp_path):
    config = tiny_config(num_hidden_layers=7, stem_layers="1/2", qk_norm=True)
    assert config.stem_layers == [1, 3, 5]
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["stem_layers"] == [1, 3, 5]
    assert saved["model_type"] == "stem" and saved["qk_norm"] is True
    loaded = StemConfig.from_pretrained(tmp_path)
    assert loaded.stem_layers == [1, 3, 5] and loaded.qk_norm is True
    assert loaded.rope_parameters == config.rope_parameters


def test_config_defaults_resolve():
    config = StemConfig(num_hidden_layers=16)
    assert config.stem_layers == [1, 4, 7, 10, 13]
    assert config.num_key_value_heads == config.num_attention_heads
    assert config.head_dim == config.hidden_size // config.num_attention_heads
    assert config.rope_parameters["rope_type"] == "default"


def test_invalid_config_raises_at_construction():
    with pytest.raises(ValueError, match="stem_layers: layer index 4 is out of range"):
        tiny_config(stem_layers=[4])
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny_config(num_attention_heads=4, num_key_value_heads=3)


def test_stem_layers_and_table_dtype_set_on_a_built_config_are_resolved_and_checked_where_they_are_set():
    import torch

    from stem_hf import StemModel

    config = tiny_config()
    config.stem_layers = "1/2"
    assert config.stem_layers == [1, 3]  # the explicit list at once, not when a model is built
    config.stem_layers = "full"
    assert config.stem_layers == [1, 2, 3] and json.loads(config.to_json_string())["stem_layers"] == [1, 2, 3]
    with pytest.raises(ValueError, match="layer index 9 is out of range"):
        config.stem_layers = [9]
    assert config.torch_table_dtype == torch.bfloat16
    config.table_dtype = "float32"
    assert config.torch_table_dtype == torch.float32
    with pytest.raises(ValueError, match="table_dtype: 'int8' is not one of"):
        config.table_dtype = "int8"
    config.num_hidden_layers = 3  # after the layers: the model refuses rather than build a table for no layer
    with pytest.raises(ValueError, match=r"stem_layers \[1, 2, 3\]: no such layer in 3 layers"):
        StemModel(config)


# Config values that would build a broken model are refused, naming the field (issues 23 and 35).


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"stem_layers": 3}, r"stem_layers: 3 is neither a list nor a string.*write \[3\]"),
        ({"vocab_size": 0}, "vocab_size: 0 must be a positive integer"),
        ({"vocab_size": "96"}, "vocab_size: '96' must be a positive integer"),
        ({"intermediate_size": -64}, "intermediate_size: -64 must be a positive integer"),
        ({"intermediate_size": 64.0}, "intermediate_size: 64.0 must be a positive integer"),
        ({"pad_token_id": 96}, r"pad_token_id: 96 is neither a token id in the vocabulary \[0, 96\)"),
        ({"pad_token_id": -97}, "pad_token_id: -97 is neither a token id"),
        # issue 35: sizes and numbers that built a model giving NaN, or failed deep in torch
        ({"num_key_value_heads": 0}, "num_key_value_heads: 0 must be a positive integer"),
        ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
        ({"head_dim": 0}, "head_dim: 0 must be a positive integer"),
        ({"max_position_embeddings": -3}, "max_position_embeddings: -3 must be a positive integer"),
        ({"vocab_size": 10**20}, r"vocab_size: 100000000000000000000 is larger than the largest size .*2147483647"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps: nan must be a positive finite number"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps: 0.0 must be a positive finite number"),
        ({"initializer_range": float("inf")}, r"initializer_range: inf must be a finite number >= 0"),
        ({"attention_dropout": 1.5}, r"attention_dropout: 1.5 must be a probability in \[0, 1\)"),
        ({"hidden_act": "swish2"}, "hidden_act: 'swish2' is not an activation transformers knows"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, r"rope_theta'\]: -1.0 must be a positive"),
        (
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": float("nan")}},
            r"rope_parameters\['factor'\]: nan must be a positive finite number",
        ),
    ],
)
def test_bad_config_values_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_negative_pad_ids_index_from_the_end_as_torch_takes_them():
    assert tiny_config(pad_token_id=-1).pad_token_id == -1
    assert tiny_model(pad_token_id=-1).model.embed_tokens.padding_idx == 95


def test_stem_config_keeps_llama_fields_valid_for_dense_sources():
    from transformers import LlamaConfig

    from stem_hf.conversion.sources import stem_config_from_dense

    dense = LlamaConfig(**{**TINY, "pad_token_id": -1})
    assert stem_config_from_dense(dense, "1/2").pad_token_id is None  # "-1: no pad token" in some Llama configs
    assert isinstance(StemConfig(**TINY), StemConfig)


def test_a_ratio_follows_num_hidden_layers_set_after_it_in_any_order():
    base = tiny_config().to_dict()
    assert "_stem_layers_spec" not in base  # never saved
    assert StemConfig.from_dict(base, stem_layers="1/2", num_hidden_layers=8).stem_layers == [1, 3, 5, 7]
    config = tiny_config()
    config.update({"stem_layers": "full", "num_hidden_layers": 6})
    assert config.stem_layers == [1, 2, 3, 4, 5]
    config.update({"num_hidden_layers": 8, "stem_layers": "full"})
    assert config.stem_layers == list(range(1, 8))
    config.stem_layers = [1, 2]  # an explicit list is the user's: it does not follow
    config.num_hidden_layers = 6
    assert config.stem_layers == [1, 2]
