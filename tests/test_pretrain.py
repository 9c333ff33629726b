"""`stem-hf pretrain` on a tiny generated corpus: both models train on the same tokens, active parameters match, the
results JSON and the PNG are written."""

import json
import math
import random

import pytest

from stem_hf.cli import main
from stem_hf.pretrain import PretrainSettings, configs, split_corpus

WORDS = {
    "adj": ["red", "small", "old", "quiet", "bright", "green"],
    "noun": ["fox", "river", "house", "king", "garden", "ship"],
    "verb": ["sees", "finds", "leaves", "follows", "builds"],
}


def _corpus(n: int = 1500) -> str:
    rng = random.Random(0)
    pick = lambda kind: rng.choice(WORDS[kind])  # noqa: E731
    return " ".join(f"the {pick('adj')} {pick('noun')} {pick('verb')} the {pick('noun')}." for _ in range(n))


def test_active_parameters_match_and_the_split_is_disjoint():
    settings = PretrainSettings(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4)
    dense, stem = configs(settings, 512)
    from stem_hf.accounting import summarize

    a, b = summarize(dense)["active_params_per_token"], summarize(stem)["active_params_per_token"]
    assert stem.stem_layers == [1, 3] and stem.intermediate_size > dense.intermediate_size
    assert abs(a - b) / a < 0.01
    text = "".join(f"{i:04d}" * 250 for i in range(40))  # 40 distinct 1000-character pieces
    train, valid = split_corpus([text], 0.1, seed=0, piece=1000)
    assert len(valid) == 4 and len(train) == 36 and not set(valid) & set(train)
    assert sorted(train + valid) == sorted(text[i : i + 1000] for i in range(0, 40_000, 1000))
    with pytest.raises(ValueError, match="too little text"):
        split_corpus(["short"], 0.1, seed=0)


def test_stem_hf_pretrain_trains_both_models_on_the_same_tokens(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(_corpus())
    out = tmp_path / "run"
    main(
        [
            "pretrain",
            str(corpus),
            "--out",
            str(out),
            "--vocab-size",
            "300",
            "--hidden-size",
            "32",
            "--intermediate-size",
            "64",
            "--layers",
            "2",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--context",
            "32",
            "--batch-size",
            "8",
            "--steps",
            "30",
            "--eval-every",
            "10",
        ]
    )
    result = json.loads((out / "results.json").read_text())
    assert '"stem_over_dense"' in capsys.readouterr().out
    dense, stem = result["runs"]["dense"], result["runs"]["STEM-1/2"]
    assert stem["stem_layers"] == [1] and dense["stem_layers"] == []
    assert abs(result["stem_over_dense"]["active_params"] - 1) < 0.05
    assert stem["total_params"] > dense["total_params"]
    for run in (dense, stem):
        assert [step for step, _ in run["valid_loss"]] == [10 * 256, 20 * 256, 30 * 256]
        assert run["final_valid_loss"] < math.log(300) - 1.5  # well below a uniform guess
        assert run["train_loss"][-1][1] < run["train_loss"][0][1]
    assert result["tokens_trained"] == 30 * 8 * 32
    assert (out / "curves.png").stat().st_size > 10_000
    assert (out / "tokenizer" / "tokenizer.json").is_file()


def test_the_paper_recipe_sets_the_reference_arguments_and_refuses_a_table_rate(tmp_path):
    from stem_hf.pretrain import training_arguments
    from stem_hf.training import PAPER_ARGUMENTS, check_paper_arguments

    args = training_arguments(tmp_path, PretrainSettings(recipe="paper"))
    check_paper_arguments(args)  # raises where a field differs
    assert args.adam_beta2 == 0.95 and args.lr_scheduler_kwargs == PAPER_ARGUMENTS["lr_scheduler_kwargs"]
    with pytest.raises(ValueError, match="adam_beta2=0.95"):
        check_paper_arguments(training_arguments(tmp_path, PretrainSettings()))
    with pytest.raises(ValueError, match="recipe: 'lingua' is not one of stem-hf, paper"):
        PretrainSettings(recipe="lingua")
    with pytest.raises(ValueError, match="sets adam_beta2 itself"):
        PretrainSettings(recipe="paper", extra={"adam_beta2": 0.999})
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(_corpus(10))
    with pytest.raises(ValueError, match="leave table_lr unset"):  # before any tokenizer or model is trained
        main(["pretrain", str(corpus), "--out", str(tmp_path / "run"), "--recipe", "paper", "--table-lr", "0.01"])
    assert not (tmp_path / "run").exists()
