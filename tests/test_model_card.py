"""Model cards: rendered for a converted model with figures that match the model, valid Hub metadata, written by
`save_pretrained` when absent, refreshed when stem-hf wrote them, and never written over a card a person wrote."""

import json
import logging

import pytest
from huggingface_hub import ModelCard
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from stem_hf import StemConfig, StemForCausalLM
from stem_hf.accounting import flops_per_token, num_active_parameters, num_table_parameters
from stem_hf.conversion import convert
from stem_hf.model_card import MARKER, render_model_card, write_model_card
from tests import conftest
from tests.conftest import BYTE_VOCAB, byte_tokenizer, tiny_model

SHAPE = {**conftest.SHAPE, "vocab_size": BYTE_VOCAB, "num_hidden_layers": 6, "max_position_embeddings": 256}
TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun. " * 8


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("card") / "stem-1-2"
    dense = LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=False)).eval()
    tokenizer = byte_tokenizer()
    model, report = convert(
        dense,
        out,
        stem_layers="1/2",
        calibration=[TEXT, TEXT.upper()],
        heldout=[TEXT.lower()],
        tokenizer=tokenizer,
        table_dtype="float32",
        heal_tokens=300,
        heal_options={"log_every": 1},
        chunk_len=128,
        calibration_name="two test sentences",
        base_model="example-org/tiny-dense",
        license="apache-2.0",
    )
    assert tokenizer("the fox").input_ids[0] != SHAPE["bos_token_id"]  # the caller's tokenizer is left as it was
    return model, report, out, dense


def test_the_saved_tokenizer_prepends_bos_as_calibration_did(converted):
    model, report, out, dense = converted
    assert report["bos_prepended"]
    assert AutoTokenizer.from_pretrained(out)("the fox").input_ids[0] == model.config.bos_token_id
    assert "The tokenizer starts every sequence with BOS" in (out / "README.md").read_text()


def test_the_card_of_a_converted_model_states_its_figures(converted):
    model, report, out, dense = converted
    text = (out / "README.md").read_text()
    assert MARKER in text
    context = min(2048, model.config.max_position_embeddings)
    figures = [
        f"{model.num_parameters():,}",
        f"{num_table_parameters(model):,}",
        f"{num_active_parameters(model):,}",
        f"| total parameters | {model.num_parameters():,} ({model.num_parameters() / 1e6:.1f}M) | "
        f"{dense.num_parameters():,} ({dense.num_parameters() / 1e6:.1f}M) |",  # the source, counted by transformers
        f"All tables: {num_table_parameters(model):,} ({num_table_parameters(model) / 1e6:.1f}M) parameters, "
        f"{num_table_parameters(model) * 4 / 1e6:.1f} MB in `float32`",
        f"{flops_per_token(model.config, context):,}",
        f"{flops_per_token(model.config, context, dense=True):,}",
        f"{flops_per_token(model.config, context) / flops_per_token(model.config, context, dense=True):.3f} of dense",
        f"STEM layers: {', '.join(map(str, model.config.stem_layers))}",
        f"{report['calibration_tokens']:,} tokens of two test sentences",
        f"{report['vocab_coverage']:.1%} of the vocabulary",
        f"on {report['heal_tokens']:,} tokens of {report['heal_text']},\n  training `all`.",  # fp32: no autocast
        f"| dense source, as loaded for the conversion | {report['heldout_perplexity_dense']:.2f} | 1.00x |",
        f"| STEM (this model) | {report['heldout_perplexity_stem']:.2f} | {report['perplexity_ratio']:.2f}x |",
        "Converted from the dense **example-org/tiny-dense**\n(LlamaForCausalLM)",
        "rows of unseen tokens are predicted from their embeddings",
        "`apache-2.0`",
        'from_pretrained("' + str(out) + '", trust_remote_code=True)',
    ]
    for figure in figures:
        assert figure in text, figure
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for file in set(index["weight_map"].values()):
        size = (out / file).stat().st_size
        assert f"`{file}`" in text and f"{size / 1e6:.1f} MB" in text


def test_the_card_metadata_is_valid_hub_yaml(converted):
    model, report, out, dense = converted
    card = ModelCard.load(out / "README.md")
    data = card.data
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert {"stem", "custom_code"} <= set(data.tags)
    assert data.base_model == "example-org/tiny-dense" and data.license == "apache-2.0"
    (perplexity,) = [r for r in data.eval_results if r.metric_type == "perplexity"]
    assert perplexity.metric_value == pytest.approx(report["heldout_perplexity_stem"], abs=1e-3)
    assert data.to_dict()["model-index"][0]["name"] == out.name


def test_a_model_built_from_a_config_gets_an_architecture_card(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path / "scratch")
    text = (tmp_path / "scratch" / "README.md").read_text()
    assert "not converted from a dense checkpoint" in text and "Not recorded" in text
    assert f"{model.num_parameters():,}" in text
    assert ModelCard.load(tmp_path / "scratch" / "README.md").data.base_model is None


def test_saves_refresh_a_generated_card_and_keep_a_written_one(tmp_path):
    model = tiny_model()
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    report = {"source": "somewhere", "heldout_perplexity_dense": 10.0, "heldout_perplexity_stem": 12.0}
    (folder / "conversion_report.json").write_text(json.dumps({**report, "perplexity_ratio": 1.2}))
    model.save_pretrained(folder)  # the generated card is refreshed: it now describes a conversion
    assert "| STEM (this model) | 12.00 | 1.20x |" in (folder / "README.md").read_text()
    (folder / "README.md").write_text("# My notes\n")
    model.save_pretrained(folder)
    assert write_model_card(folder) is None
    assert (folder / "README.md").read_text() == "# My notes\n"
    assert write_model_card(folder, overwrite=True) == folder / "README.md"
    assert MARKER in (folder / "README.md").read_text()


def test_tags_and_repo_id_reach_the_card(tmp_path):
    model = tiny_model()
    model.add_model_tags(["my-experiment"])
    model.save_pretrained(tmp_path / "ckpt")
    card = render_model_card(tmp_path / "ckpt", repo_id="someone/stem-tiny")
    assert "my-experiment" not in card.data.tags  # render_model_card takes tags explicitly...
    assert "my-experiment" in ModelCard.load(tmp_path / "ckpt" / "README.md").data.tags  # ...saves pass the model's
    assert 'from_pretrained("someone/stem-tiny", trust_remote_code=True)' in str(card)


def test_a_corrupt_report_is_a_warning_on_save_and_an_error_when_asked(tmp_path, caplog):
    model = tiny_model()
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    (folder / "conversion_report.json").write_text("{not json")
    (folder / "README.md").unlink()
    with caplog.at_level(logging.WARNING):
        model.save_pretrained(folder)
    assert "no model card written" in caplog.text and "conversion_report.json" in caplog.text
    assert StemForCausalLM.from_pretrained(folder).config.stem_layers == model.config.stem_layers
    with pytest.raises(ValueError, match="conversion_report.json is not valid JSON"):
        write_model_card(folder)
    with pytest.raises(OSError):
        render_model_card(tmp_path / "nowhere")
    assert isinstance(StemConfig.from_pretrained(folder), StemConfig)


@pytest.mark.parametrize(
    ("report", "says"),
    [
        ({"refit": "all"}, "of every layer after the first STEM layer refit in closed form"),
        (
            {
                "refit": "all",
                "gate_epochs": 5,
                "dense_epochs": 5,
                "stem_layers": [1, 3],
                "locally_trained_layers": [1, 2, 3],
            },
            "the gates of layers 1, 3 trained locally along the way (5 epochs) and the gate and up projections of "
            "layer 2 trained",
        ),
        (
            {
                "refit": "sequential",
                "gate_epochs": 3,
                "dense_epochs": 0,
                "stem_layers": [1],
                "locally_trained_layers": [],
            },
            "bring the residual stream back to the dense model's.",  # training was not kept anywhere: not claimed
        ),
        ({"refit": "plain"}, "refit in closed form to the dense FFN outputs"),
        ({"refit_down": True, "sequential": True}, "refit in closed form, layer by layer"),  # reports before `refit`
        ({"refit_down": True}, "refit in closed form to the dense FFN outputs"),
        ({"refit": "none"}, None),
    ],
)
def test_the_card_says_which_refit_ran(tmp_path, report, says):
    folder = tmp_path / "ckpt"
    tiny_model().save_pretrained(folder)
    (folder / "conversion_report.json").write_text(json.dumps({"source": "somewhere", "init": "fitted", **report}))
    text = str(render_model_card(folder))
    assert "tables initialized with `fitted`" in text
    if says is None:
        assert "refit" not in text.split("tables initialized with")[1].split("\n")[0]
    else:
        assert says in text


@pytest.mark.parametrize("prior_context", [None, " the"])
def test_the_card_says_what_unseen_rows_lean_on(tmp_path, prior_context):
    folder = tmp_path / "ckpt"
    tiny_model().save_pretrained(folder)
    report = {"source": "somewhere", "init": "fitted", "prior_context": prior_context, "calibration_tokens": 10}
    report["bos_prepended"] = True
    (folder / "conversion_report.json").write_text(json.dumps(report))
    text = str(render_model_card(folder))
    assert "rows of unseen tokens are predicted from their embeddings" in text
    assert ("FFN inputs after BOS and ' the'" in text) == (prior_context is not None)
