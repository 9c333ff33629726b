"""The analyses on constructed tables (orthogonal rows give |cos| ~0, identical rows give 1), activated parameters on a
known stream, and `stem-hf analyze` end to end on a tiny model."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from stem_hf.analysis import activated_parameters, angular_spread, dense_up_spread, table_spread
from stem_hf.cli import main
from stem_hf.conversion import convert
from tests.conftest import BYTE_VOCAB, byte_tokenizer, tiny_model


def test_orthogonal_rows_spread_fully_and_identical_rows_not_at_all():
    orthogonal = angular_spread(torch.eye(64) * 3.0)
    assert orthogonal["p95_abs_cos"] < 1e-6 and orthogonal["mean_abs_cos"] < 1e-6
    identical = angular_spread(torch.ones(64, 16) * torch.arange(1, 65)[:, None])  # same direction, other lengths
    assert identical["p95_abs_cos"] == pytest.approx(1.0) and identical["median_abs_cos"] == pytest.approx(1.0)
    opposite = angular_spread(torch.cat([torch.ones(8, 4), -torch.ones(8, 4)]))
    assert opposite["mean_abs_cos"] == pytest.approx(1.0)  # |cos|: opposite directions are not spread
    random = angular_spread(torch.randn(2000, 512))
    assert random["p95_abs_cos"] == pytest.approx(1.96 / 512**0.5, rel=0.15)  # ~N(0, 1/d) for random directions
    assert sum(random["histogram"]) == random["pairs"]
    with pytest.raises(ValueError, match="at least 2 nonzero rows"):
        angular_spread(torch.zeros(5, 3))


def test_table_spread_reads_the_rows_of_the_texts_tokens():
    model = tiny_model()
    with torch.no_grad():
        model.model.stem_tables["1"].weight.copy_(torch.eye(96, 64))  # rows 0-63 orthogonal, 64-95 zero
        model.model.stem_tables["3"].weight.fill_(1.0)
    spread = table_spread(model, torch.tensor([[3, 4, 5, 6, 70], [5, 6, 7, 8, 9]]))
    assert spread[1]["rows"] == 7 and spread[1]["p95_abs_cos"] < 1e-6  # row 70 is zero: dropped
    assert spread[3]["p95_abs_cos"] == pytest.approx(1.0)


def test_dense_up_spread_hooks_the_up_projection_at_the_named_layers():
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    dense = LlamaForCausalLM(config).eval()
    chunks = [torch.randint(0, 96, (20,)) for _ in range(3)]
    spread = dense_up_spread(dense, chunks, [0, 2], pairs=500)
    assert set(spread) == {0, 2} and spread[0]["rows"] == 3 * 19  # position 0 of each chunk left out
    assert all(m.mlp.up_proj._forward_hooks == {} for m in dense.model.layers)


def test_activated_parameters_count_distinct_tokens_per_window():
    stream = torch.tensor([1, 2, 1, 2, 3, 4, 5, 6] * 8)
    result = activated_parameters(stream, [2, 4, 128], rows_per_token=10, windows=16)
    assert set(result) == {"2", "4"}  # 128 is longer than the stream
    assert result["2"]["distinct_tokens"] == 2 and result["2"]["activated_table_params"] == 20
    assert 2 < result["4"]["distinct_tokens"] <= 4


def test_stem_hf_analyze_writes_json_and_plots(tmp_path, capsys):
    model = tiny_model(vocab_size=BYTE_VOCAB, max_position_embeddings=128)
    model.save_pretrained(tmp_path / "m")
    byte_tokenizer().save_pretrained(tmp_path / "m")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 60)
    main(["analyze", str(tmp_path / "m"), "--text", str(text), "--out", str(tmp_path / "a")])
    result = json.loads((tmp_path / "a" / "analysis.json").read_text())
    assert set(result["table_spread"]) == {"1", "3"} and "512" in result["activated"]
    for png in ("angular_spread.png", "activated_parameters.png"):
        assert (tmp_path / "a" / png).stat().st_size > 10_000
    assert "p95_abs_cos_tables" in capsys.readouterr().out


def test_stem_hf_analyze_compares_with_the_dense_source_its_report_names(tmp_path):
    dense_config = LlamaConfig(
        vocab_size=BYTE_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1,
    )
    LlamaForCausalLM(dense_config).save_pretrained(tmp_path / "dense")
    byte_tokenizer().save_pretrained(tmp_path / "dense")
    convert(str(tmp_path / "dense"), tmp_path / "stem", stem_layers=[1], init="projected")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 60)
    main(["analyze", str(tmp_path / "stem"), "--text", str(text), "--out", str(tmp_path / "a")])
    result = json.loads((tmp_path / "a" / "analysis.json").read_text())
    assert set(result["dense_up_spread"]) == {"1"}  # the reference spread, from the source the report names


def test_stem_hf_analyze_names_a_corrupt_conversion_report(tmp_path):
    model = tiny_model(vocab_size=BYTE_VOCAB)
    model.save_pretrained(tmp_path / "m")
    byte_tokenizer().save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "conversion_report.json").write_text("{not json")
    with pytest.raises(ValueError, match="conversion_report.json: not a conversion report.*--dense"):
        main(["analyze", str(tmp_path / "m"), "--out", str(tmp_path / "a")])
