import json
import subprocess
import sys
from pathlib import Path

import pytest

from stem_hf.accounting import flops_per_token, num_active_parameters, num_table_parameters
from stem_hf.cli import main
from tests.conftest import tiny_model


def test_info_reports_accounting(tmp_path, capsys):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    main(["info", str(tmp_path), "--context-length", "32"])
    report = json.loads(capsys.readouterr().out)
    assert report["stem_layers"] == [1, 3]
    assert report["table_params"] == num_table_parameters(model)
    assert report["active_params_per_token"] == num_active_parameters(model)
    assert report["flops_per_token"] == flops_per_token(model.config, 32)
    assert report["flops_ratio_stem_over_dense"] < 1


def test_info_refuses_a_non_stem_config(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="holds a 'llama' config, not a STEM one"):
        main(["info", str(tmp_path)])


def test_demo_runs_end_to_end(tmp_path):
    result = subprocess.run(  # a relative --out, as `make demo` passes
        [sys.executable, "-m", "stem_hf.cli", "demo", "--tiny", "--out", "demo-out"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "max |logit diff| = 0.0e+00" in result.stdout
    report = json.loads(result.stdout[result.stdout.index("{") :])
    assert report["max_abs_logit_diff"] == 0.0 and report["stem_layers"] == [1, 3, 5]
    assert (tmp_path / "demo-out" / "stem-tiny" / "modeling_stem.py").is_file()


def test_the_conversion_demo_runs_on_any_supported_source(tmp_path, capsys):
    """`stem-hf demo --source`: the `make demo` path end to end (convert with the bundled corpus, heal in bf16, save,
    reload with trust_remote_code, compare), on a tiny Llama with a byte tokenizer instead of SmolLM2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import BYTE_VOCAB, TINY, byte_tokenizer

    config = {**TINY, "vocab_size": BYTE_VOCAB, "max_position_embeddings": 512, "num_hidden_layers": 3}
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(tmp_path / "src")
    byte_tokenizer().save_pretrained(tmp_path / "src")
    out = tmp_path / "out"
    main(
        ["demo", "--source", str(tmp_path / "src"), "--out", str(out), "--calibration-tokens", "3000"]
        + ["--heal-tokens", "1000", "--heal-precision", "bf16"]
    )
    printed = capsys.readouterr().out
    report = json.loads(printed[printed.index("\n{") :])
    assert report["stem_layers"] == [1] and report["heal_tokens"] == 1000 and report["heal_precision"] == "bf16"
    assert report["remote_code_max_abs_diff"] == 0.0
    assert "after 1000 healing tokens" in printed and "bf16" in printed
    assert printed.count("    STEM:  ") == 3
    saved = json.loads((out / "stem-1-3" / "conversion_report.json").read_text())
    assert saved["source"] == str(tmp_path / "src") and saved["heal_precision"] == "bf16"
    assert "training `all` under bf16 autocast." in (out / "stem-1-3" / "README.md").read_text()


def test_the_cli_offers_every_healing_precision_heal_takes():
    from stem_hf.cli import build_parser
    from stem_hf.conversion.heal import PRECISIONS

    commands = build_parser()._subparsers._group_actions[0].choices
    for command in ("convert", "demo"):
        offered = next(a.choices for a in commands[command]._actions if a.dest == "heal_precision")
        assert tuple(offered) == PRECISIONS


def test_the_conversion_script_takes_the_convert_command_options(capsys):
    import runpy

    script = runpy.run_path(str(Path(__file__).resolve().parent.parent / "conversion" / "convert_llama_to_stem.py"))
    with pytest.raises(SystemExit) as exit_info:
        script["main"](["--help"])
    assert exit_info.value.code == 0
    assert "--stem-layers" in capsys.readouterr().out
