import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

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


@pytest.mark.slow
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


@pytest.mark.slow
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


# CLI fault cases. Bad option values are refused while the command line is parsed (or, for what only the files
# tell, before any model loads), each with a message that names the option and the problem.


@pytest.fixture
def checkpoint(tmp_path) -> str:
    """A tiny STEM checkpoint with a byte tokenizer: every command could run on it, so an error is the option's."""
    from tests.conftest import BYTE_VOCAB, byte_tokenizer

    folder = tmp_path / "stem"
    tiny_model(vocab_size=BYTE_VOCAB, max_position_embeddings=128).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return str(folder)


def _parse_error(argv: list[str], capsys) -> str:
    """What argparse printed on refusing `argv`: it exits with status 2 before the command runs."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "command, option, value, minimum",
    [
        ("info", "--context-length", "-5", 1),
        ("info", "--context-length", "0", 1),
        ("eval", "--batch-size", "0", 1),
        ("eval", "--num-fewshot", "-1", 0),
        ("edit", "--max-new-tokens", "0", 1),
        ("pretrain", "--steps", "0", 1),
        ("pretrain", "--hidden-size", "-8", 1),
        ("convert", "--calibration-tokens", "0", 1),
        ("convert", "--gate-epochs", "-1", 0),
        ("convert", "--heal-tokens", "-2", 0),
        ("demo", "--heal-tokens", "-2", 0),
        ("lab", "--people", "1", 2),
        ("lab", "--steps", "0", 1),
        ("lab", "--capacity", "1", 2),
    ],
)
def test_whole_number_options_are_checked_when_parsed(tmp_path, checkpoint, capsys, command, option, value, minimum):
    argv = {
        "info": ["info", checkpoint],
        "eval": ["eval", checkpoint, "--tasks", "stem_facts", "--output", str(tmp_path / "results.json")],
        "edit": ["edit", checkpoint, "--source", " a", "--target", " b", "--prompt", "a b"],
        "pretrain": ["pretrain", str(tmp_path / "corpus.txt"), "--out", str(tmp_path / "runs")],
        "convert": ["convert", checkpoint, str(tmp_path / "out")],
        "demo": ["demo", "--out", str(tmp_path / "out")],
        "lab": ["lab", "--out", str(tmp_path / "runs")],
    }[command]
    err = _parse_error([*argv, option, value], capsys)
    assert f"{option}: must be a whole number of at least {minimum}, not '{value}'" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()


def test_learning_rates_are_checked_when_parsed(tmp_path, capsys):
    for option, value, problem in [("--lr", "0", "must be above 0"), ("--table-lr", "nan", "must be a finite number")]:
        err = _parse_error(["pretrain", str(tmp_path / "corpus.txt"), option, value], capsys)
        assert f"argument {option}: {problem}, not '{value}'" in err
    err = _parse_error(["convert", "src", str(tmp_path / "out"), "--heal-lr=-1e-4"], capsys)  # "=": not an option
    assert "argument --heal-lr: must be at least 0, not '-1e-4'" in err
    err = _parse_error(["convert", "src", str(tmp_path / "out"), "--heal-anneal", "1.5"], capsys)
    assert "argument --heal-anneal: must be a share in [0, 1], not '1.5'" in err


@pytest.mark.parametrize("limit", ["inf", "nan", "-inf", "0", "-1", "1.5"])
def test_eval_refuses_a_limit_that_is_no_count_nor_fraction_when_parsed(tmp_path, checkpoint, capsys, limit):
    output = tmp_path / "results.json"
    err = _parse_error(
        ["eval", checkpoint, "--tasks", "stem_facts", f"--limit={limit}", "--output", str(output)], capsys
    )
    assert "argument --limit: must be" in err and f"not '{limit}'" in err
    assert not output.exists()


def test_eval_takes_a_limit_as_lm_eval_does():
    from stem_hf.cli import build_parser

    parse = build_parser().parse_args
    limits = {text: parse(["eval", "CK", "--tasks", "t", "--limit", text]).limit for text in ("2", "2.0", "0.25")}
    assert limits == {"2": 2, "2.0": 2, "0.25": 0.25}
    assert type(limits["2.0"]) is int


def test_eval_names_host_tables_as_the_config_does_and_takes_the_old_flag_with_a_warning(tmp_path, capsys):
    from stem_hf.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["eval", "CK", "--tasks", "t"]).keep_tables_on_cpu is True
    assert parse(["eval", "CK", "--tasks", "t", "--no-keep-tables-on-cpu"]).keep_tables_on_cpu is False
    LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path)  # fmt: skip
    for flag in ("--no-keep-tables-on-cpu", "--tables-on-device"):  # a dense model has no tables to move
        with pytest.raises(ValueError, match="keep_tables_on_cpu: .* has no STEM tables"):
            main(["eval", str(tmp_path), "--tasks", "stem_facts", flag, "--output", str(tmp_path / "r.json")])
        deprecated = "--tables-on-device is deprecated; use --no-keep-tables-on-cpu" in capsys.readouterr().err
        assert deprecated is (flag == "--tables-on-device")


@pytest.mark.parametrize("out", ["", "checkpoint", "other folder"])
def test_offload_store_refuses_an_out_that_is_no_file_path_before_writing(
    tmp_path, checkpoint, monkeypatch, capsys, out
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "other folder").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir()), sorted(os.listdir(checkpoint))
    path = {"": "", "checkpoint": checkpoint, "other folder": str(tmp_path / "other folder")}[out]
    err = _parse_error(["offload-store", checkpoint, "--out", path], capsys)
    expected = "argument --out: empty; name the file to write" if not out else f"argument --out: {path} is a folder"
    assert expected in err
    assert (sorted(p.name for p in tmp_path.iterdir()), sorted(os.listdir(checkpoint))) == before  # no .partial


@pytest.mark.parametrize("option", ["--prompt", "--source", "--target"])
def test_edit_refuses_text_that_is_not_utf8_when_parsed(checkpoint, capsys, option):
    """Bytes that are not UTF-8 in argv (b"a\\xff") reach Python as surrogate escapes ("a\\udcff")."""
    texts = {"--prompt": "the fox", "--source": " fox", "--target": " dog", option: "a\udcff"}
    argv = ["edit", checkpoint, *(word for pair in texts.items() for word in pair)]
    err = _parse_error(argv, capsys)
    assert f"argument {option}: b'a\\xff' is not valid UTF-8" in err


def test_convert_refuses_card_and_prior_context_text_that_is_not_utf8_when_parsed(tmp_path, capsys):
    for option in ("--prior-context", "--base-model", "--license"):
        err = _parse_error(["convert", "src", str(tmp_path / "out"), option, "x\udcff"], capsys)
        assert f"argument {option}: b'x\\xff' is not valid UTF-8" in err
    assert not (tmp_path / "out").exists()


def test_card_writes_for_a_folder_whose_name_is_not_utf8(tmp_path, capsys):
    folder = os.fsdecode(os.fsencode(str(tmp_path)) + b"/ck\xff")  # 'ck\udcff': what argv gives for such a name
    tiny_model().save_pretrained(folder)
    main(["card", folder])
    card = (tmp_path / os.fsdecode(b"ck\xff") / "README.md").read_bytes().decode("utf-8")  # valid UTF-8 throughout
    assert "# ck\ufffd" in card and f'from_pretrained("{tmp_path}/ck\ufffd"' in card
    assert capsys.readouterr().out == f"wrote {tmp_path}/ck\ufffd/README.md\n"


MYSTERY_CODE = """import pathlib
pathlib.Path({marker!r}).write_text("the source's own code ran")
"""


@pytest.mark.parametrize("command", ["convert", "analyze"])
def test_a_source_with_its_own_code_is_refused_from_its_config_before_transformers(
    tmp_path, checkpoint, monkeypatch, command
):
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    source, marker = tmp_path / "mystery", tmp_path / "MARKER"
    source.mkdir()
    config = {"model_type": "mystery", "auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}
    (source / "config.json").write_text(json.dumps(config))
    (source / "modeling_x.py").write_text(MYSTERY_CODE.format(marker=str(marker)))
    argv = {
        "convert": ["convert", str(source), str(tmp_path / "out"), "--init", "projected", "--refit", "none"],
        "analyze": ["analyze", checkpoint, "--dense", str(source), "--out", str(tmp_path / "out")],
    }[command]
    with pytest.raises(ValueError) as error:
        main(argv)
    message = str(error.value)
    assert "cannot convert mystery: supported source architectures are LlamaForCausalLM, MistralForCausalLM" in message
    assert "model_type 'mystery'" in message and "ships its own code (auto_map), which stem-hf never runs" in message
    assert not marker.exists() and not (tmp_path / "modules").exists() and not (tmp_path / "out").exists()


def test_the_disk_room_message_gives_sizes_in_a_unit_that_fits(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from stem_hf.accounting import check_disk_room, format_bytes

    assert [format_bytes(n) for n in (512, 25_000_000, 999_999, 1.5e9, 2e12)] == [
        "512 B", "25.0 MB", "1.0 MB", "1.5 GB", "2.0 TB"
    ]  # fmt: skip
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 10**7, 10**7))
    with pytest.raises(OSError, match=r"store: the store takes 25\.0 MB and .* has 10\.0 MB free$"):
        check_disk_room(tmp_path / "store", 25_000_000, "the store takes")
