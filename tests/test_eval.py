"""lm-eval on STEM checkpoints: the real `lm_eval` CLI on a saved checkpoint, the Python API on a loaded model, and
`stem-hf eval`, all on the shipped offline tasks (loglikelihood, generate_until and loglikelihood_rolling requests)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from stem_hf.cli import main
from stem_hf.evaluation import RESULTS_FILE, TASKS_DIR, evaluate, headline_metrics, load_for_eval
from tests.conftest import BYTE_VOCAB, _mapped_files, byte_tokenizer, tiny_model

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
EXPECTED = {  # task -> a metric key lm-eval reports for it
    "stem_facts": "acc,none",
    "stem_complete": "exact_match,first_word",
    "stem_prose": "word_perplexity,none",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval") / "stem-tiny"
    model = tiny_model(vocab_size=BYTE_VOCAB, max_position_embeddings=128)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def cli_results(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("lm_eval_out")
    command = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={checkpoint},trust_remote_code=True,dtype=float32",
        "--device",
        "cpu",
        "--tasks",
        "stem_offline",
        "--include_path",
        str(TASKS_DIR),
        "--output_path",
        str(out),
    ]
    run = subprocess.run(command, env={**os.environ, **OFFLINE}, capture_output=True, text=True, cwd=out)
    assert run.returncode == 0, run.stderr[-3000:]
    (results_file,) = out.rglob("results_*.json")
    return json.loads(results_file.read_text())


@pytest.mark.slow
def test_the_lm_eval_cli_runs_every_request_type_on_a_saved_checkpoint(cli_results):
    for task, metric in EXPECTED.items():
        value = cli_results["results"][task][metric]
        assert isinstance(value, float), (task, value)
    assert 0.0 <= cli_results["results"]["stem_facts"]["acc,none"] <= 1.0
    assert cli_results["results"]["stem_prose"]["word_perplexity,none"] > 1.0
    assert cli_results["n-samples"]["stem_facts"]["effective"] == 40
    assert cli_results["n-samples"]["stem_complete"]["effective"] == 24
    assert cli_results["n-samples"]["stem_prose"]["effective"] == 8


@pytest.mark.slow
def test_the_python_api_on_a_loaded_model_matches_the_cli_and_keeps_tables_mapped(checkpoint, cli_results, tmp_path):
    model, tokenizer = load_for_eval(checkpoint)
    table = model.model.stem_tables["1"].weight
    assert any(f.endswith(".safetensors") for f in _mapped_files(table))
    output = tmp_path / "results.json"
    first = evaluate(model, ["stem_facts", "stem_prose"], tokenizer, output=output)
    evaluate(model, ["stem_complete"], tokenizer, output=output)  # merged into the same file
    merged = json.loads(output.read_text())
    for task, metric in EXPECTED.items():
        assert merged["results"][task][metric] == pytest.approx(cli_results["results"][task][metric], rel=1e-5)
    assert first["results"]["stem_facts"]["acc,none"] == merged["results"]["stem_facts"]["acc,none"]
    assert any(f.endswith(".safetensors") for f in _mapped_files(model.model.stem_tables["1"].weight))
    table = headline_metrics(merged)
    assert set(table) == set(EXPECTED) and "exact_match (first_word)" in table["stem_complete"]
    assert set(table["stem_facts"]) == {"acc", "acc_norm"}  # no stderr, no sample counts


@pytest.mark.slow
def test_stem_hf_eval_writes_results_next_to_the_weights_and_puts_them_in_the_card(checkpoint, capsys):
    main(["eval", str(checkpoint), "--tasks", "stem_facts", "--limit", "8"])
    results = json.loads((checkpoint / RESULTS_FILE).read_text())
    assert results["n-samples"]["stem_facts"]["effective"] == 8
    card = (checkpoint / "README.md").read_text()
    accuracy = results["results"]["stem_facts"]["acc,none"]
    assert f"| stem_facts | acc | {accuracy:.4f} | 8 of 40 (limited) |" in card  # a partial run says so
    assert results["run_config"]["stem_facts"]["limit"] == 8
    assert "stem_facts" in capsys.readouterr().out


def test_rolling_loglikelihood_scores_text_after_one_bos_with_a_bos_adding_tokenizer(checkpoint):
    from lm_eval.api.instance import Instance

    from stem_hf.evaluation import _lm_class

    model, _ = load_for_eval(checkpoint)
    tokenizer = byte_tokenizer()
    tokenizer.add_bos_token = True  # as the tokenizer of a converted checkpoint
    assert tokenizer("ab").input_ids[0] == tokenizer.bos_token_id
    lm = _lm_class()(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=1)
    text = "A short line of text."
    (got,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False).input_ids]])
    with torch.no_grad():
        expected = model(ids).logits.log_softmax(-1)[0, :-1].gather(1, ids[0, 1:, None]).sum().item()
    assert got == pytest.approx(expected, rel=1e-4)


@pytest.mark.slow
def test_a_dense_baseline_evaluates_through_the_same_path(tmp_path):
    config = LlamaConfig(
        vocab_size=BYTE_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "dense")
    byte_tokenizer().save_pretrained(tmp_path / "dense")
    results = evaluate(str(tmp_path / "dense"), ["stem_facts"], limit=4)
    assert 0.0 <= results["results"]["stem_facts"]["acc,none"] <= 1.0
    with pytest.raises(ValueError, match="keep_tables_on_cpu: .* has no STEM tables"):
        load_for_eval(tmp_path / "dense", keep_tables_on_cpu=False)
    with pytest.warns(FutureWarning, match="pass keep_tables_on_cpu"), pytest.raises(ValueError, match="no STEM"):
        load_for_eval(tmp_path / "dense", tables_on_cpu=False)  # the old name, still honoured


@pytest.mark.slow
def test_bad_eval_requests_are_clear_errors(checkpoint, tmp_path):
    model, tokenizer = load_for_eval(checkpoint)
    with pytest.raises(ValueError, match="no task or group named 'no_such_task'"):
        evaluate(model, ["no_such_task"], tokenizer)
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        evaluate(model, ["stem_facts"])
    with pytest.raises(ValueError, match="name at least one"):
        evaluate(model, [], tokenizer)
    with pytest.raises(ValueError, match="dtype: 'int8'"):
        load_for_eval(checkpoint, dtype="int8")
    model.save_pretrained(tmp_path / "no-tokenizer")
    with pytest.raises(ValueError, match="has no tokenizer"):
        load_for_eval(tmp_path / "no-tokenizer")
