import json
import subprocess
import sys

import pytest

from stem_hf.cli import main
from tests.conftest import tiny_model


def test_info_reports_accounting(tmp_path, capsys):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    main(["info", str(tmp_path), "--context-length", "32"])
    report = json.loads(capsys.readouterr().out)
    assert report["stem_layers"] == [1, 3]
    assert report["table_params"] == model.num_table_parameters()
    assert report["active_params_per_token"] == model.num_active_parameters()
    assert report["flops_per_token"] == model.flops_per_token(32)
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
