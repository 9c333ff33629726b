import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from stem_hf.accounting import flops_per_token, num_active_parameters, num_table_parameters
from stem_hf.cli import main
from stem_hf.conversion import convert
from tests.conftest import BYTE_VOCAB, SHAPE, _word_tokenizer, byte_tokenizer, tiny_model
from tests.fake_hub import fake_hub, hub_env


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

    from stem_hf.system import check_disk_room, format_bytes

    assert [format_bytes(n) for n in (512, 25_000_000, 999_999, 1.5e9, 2e12)] == [
        "512 B", "25.0 MB", "1.0 MB", "1.5 GB", "2.0 TB"
    ]  # fmt: skip
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 10**7, 10**7))
    with pytest.raises(OSError, match=r"store: the store takes 25\.0 MB and .* has 10\.0 MB free$"):
        check_disk_room(tmp_path / "store", 25_000_000, "the store takes")


# Fault cases of issue 23: `stem-hf` refuses bad arguments before it loads anything, never runs code shipped inside
# a checkpoint, never writes over its own source, and never loses evaluation results to a failed write.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_TEXT = ["--init", "projected", "--refit", "none", "--calibration", "--heldout"]


def _dense_source(folder, *, weights: bool = True, tokenizer: bool = True) -> None:
    """A tiny Llama folder. Without weights it holds only config.json: a command that got as far as loading the model
    would fail with a missing-weights error, so a test expecting another error shows the check ran first."""
    config = LlamaConfig(**SHAPE)
    if weights:
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    if tokenizer:
        _word_tokenizer().save_pretrained(folder)


def _snapshot(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _text_files(tmp_path) -> list[str]:
    files = []
    for name, seed in (("calib.txt", 1), ("held.txt", 2)):
        ids = torch.randint(3, 60, (300,), generator=torch.Generator().manual_seed(seed))
        (tmp_path / name).write_text(" ".join(f"w{i}" for i in ids.tolist()))
        files.append(str(tmp_path / name))
    return ["--calibration", files[0], "--heldout", files[1]]


# convert: OUT is never the source, never a file, never another model unless --overwrite; --stem-layers early.


@pytest.mark.parametrize("spelling", ["same", "relative", "symlink"])
def test_convert_refuses_out_equal_to_source(tmp_path, monkeypatch, spelling):
    _dense_source(tmp_path / "src")
    before = _snapshot(tmp_path / "src")
    source, out = str(tmp_path / "src"), str(tmp_path / "src")
    if spelling == "relative":
        monkeypatch.chdir(tmp_path)
        source, out = "src", "./src/"
    elif spelling == "symlink":
        (tmp_path / "link").symlink_to(tmp_path / "src", target_is_directory=True)
        out = str(tmp_path / "link")
    with pytest.raises(ValueError, match="is the source's own folder"):
        main(["convert", source, out, *NO_TEXT])
    with pytest.raises(ValueError, match="is the source's own folder"):
        main(["convert", source, out, *NO_TEXT, "--overwrite"])  # not even when asked to overwrite
    assert _snapshot(tmp_path / "src") == before


def test_python_convert_refuses_out_equal_to_source_before_loading(tmp_path):
    _dense_source(tmp_path / "src", weights=False)
    with pytest.raises(ValueError, match="is the source's own folder"):
        convert(str(tmp_path / "src"), tmp_path / "src", stem_layers=[1], init="projected")
    gguf = tmp_path / "src" / "model.gguf"  # transformers' stale-shard cleanup would delete it
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="is the source's own folder"):
        convert(str(gguf), tmp_path / "src", stem_layers=[1], init="projected")
    assert gguf.read_bytes() == b"GGUF"


def test_convert_refuses_an_out_that_holds_a_model_unless_overwrite(tmp_path, capsys):
    _dense_source(tmp_path / "src", tokenizer=False)
    _dense_source(tmp_path / "other")
    before = _snapshot(tmp_path / "other")
    with pytest.raises(FileExistsError, match=r"already holds a model \(config.json, model.safetensors\).*--overwrite"):
        main(["convert", str(tmp_path / "src"), str(tmp_path / "other"), *NO_TEXT])
    assert _snapshot(tmp_path / "other") == before
    # Asked for, it goes ahead; a source without a tokenizer converts without text.
    main(["convert", str(tmp_path / "src"), str(tmp_path / "other"), *NO_TEXT, "--stem-layers", "1", "--overwrite"])
    report = json.loads(capsys.readouterr().out)
    assert report["stem_layers"] == [1] and report["heldout_perplexity_stem"] is None
    assert json.loads((tmp_path / "other" / "config.json").read_text())["model_type"] == "stem"


def test_convert_refuses_an_out_that_is_a_file_before_loading(tmp_path):
    _dense_source(tmp_path / "src", weights=False)
    (tmp_path / "out").write_text("notes")
    with pytest.raises(FileExistsError, match="out: .*out is a file"):
        main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), *NO_TEXT])
    assert (tmp_path / "out").read_text() == "notes"


@pytest.mark.parametrize(
    "layers, message", [("7", "layer index 7 is out of range"), ("2/7", "unknown ratio '2/7'"), ("x", "cannot read")]
)
def test_convert_checks_stem_layers_against_the_source_config_before_loading(tmp_path, layers, message):
    _dense_source(tmp_path / "src", weights=False)  # 4 layers
    with pytest.raises(ValueError, match=message):
        main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--stem-layers", layers, *NO_TEXT])
    with pytest.raises(ValueError, match=message):
        convert(str(tmp_path / "src"), stem_layers=layers, init="projected")
    assert not (tmp_path / "out").exists()


def test_convert_needs_calibration_text_before_loading(tmp_path):
    _dense_source(tmp_path / "src", weights=False)
    with pytest.raises(ValueError, match="init 'fitted' needs calibration text"):
        convert(str(tmp_path / "src"), stem_layers=[1], init="fitted")
    with pytest.raises(ValueError, match="refit 'plain' needs calibration text"):
        convert(str(tmp_path / "src"), stem_layers=[1], init="projected", refit="plain")


# No command runs code shipped inside a checkpoint.

EVIL_CODE = """
import pathlib
pathlib.Path({marker!r}).write_text("the checkpoint's code ran")
from transformers import PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerFast
class EvilConfig(PreTrainedConfig):
    model_type = {model_type!r}
class EvilModel(PreTrainedModel):
    config_class = EvilConfig
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""
AUTO_MAP = {
    "AutoConfig": "evil_code.EvilConfig",
    "AutoModel": "evil_code.EvilModel",
    "AutoModelForCausalLM": "evil_code.EvilModel",
}


def _plant_code(folder, marker, model_type: str) -> None:
    """Code next to the weights that `auto_map` points every Auto class at (the tokenizer's too, if there is one)."""
    (folder / "evil_code.py").write_text(EVIL_CODE.format(marker=str(marker), model_type=model_type))
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
    (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type, "auto_map": AUTO_MAP}))
    if (folder / "tokenizer_config.json").exists():
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
        tokenizer_config["auto_map"] = {"AutoTokenizer": [None, "evil_code.EvilTokenizer"]}
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


@pytest.mark.parametrize("command", ["info", "card", "push", "edit", "analyze", "eval"])
def test_a_non_stem_checkpoint_with_its_own_code_is_refused_before_the_code_runs(tmp_path, monkeypatch, command):
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    folder, marker = tmp_path / "evil", tmp_path / "MARKER"
    folder.mkdir()
    byte_tokenizer().save_pretrained(folder)
    _plant_code(folder, marker, "evil")
    argv = {
        "info": ["info", str(folder)],
        "card": ["card", str(folder)],
        "push": ["push", str(folder), "user/evil"],
        "edit": ["edit", str(folder), "--source", " a", "--target", " b", "--prompt", "a b"],
        "analyze": ["analyze", str(folder), "--out", str(tmp_path / "analysis")],
        "eval": ["eval", str(folder), "--tasks", "stem_facts", "--output", str(tmp_path / "results.json")],
    }[command]
    message = "neither STEM nor an architecture" if command == "eval" else "holds a 'evil' config, not a STEM one"
    with pytest.raises(ValueError, match=message):
        main(argv)
    assert not marker.exists()


@pytest.mark.slow
def test_a_stem_checkpoint_with_planted_code_loads_with_the_package_classes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    folder, marker = tmp_path / "stem", tmp_path / "MARKER"
    tiny_model(vocab_size=BYTE_VOCAB, max_position_embeddings=128).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    _plant_code(folder, marker, "stem")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    main(["info", str(folder)])
    main(["edit", str(folder), "--source", "fox", "--target", "dog", "--prompt", "the fox", "-n", "2"])
    main(["analyze", str(folder), "--text", str(text), "--out", str(tmp_path / "analysis")])
    main(["eval", str(folder), "--tasks", "stem_facts", "--limit", "2", "--output", str(tmp_path / "results.json")])
    main(["card", str(folder)])
    assert not marker.exists()
    out = capsys.readouterr().out
    assert "before:" in out and "p95_abs_cos_tables" in out and "stem_facts" in out
    assert json.loads((tmp_path / "results.json").read_text())["n-samples"]["stem_facts"]["effective"] == 2


@pytest.mark.slow
def test_a_hub_checkpoint_is_refused_from_its_config_before_its_code_downloads(tmp_path):
    """On a Hub id, config.json is fetched and read as JSON; the repo's code is never fetched. A Hub-shaped id that is
    neither a folder nor a repo says so."""
    marker = tmp_path / "MARKER"
    evil = {
        "config.json": json.dumps({"model_type": "evil", "auto_map": AUTO_MAP}).encode(),
        "evil_code.py": EVIL_CODE.format(marker=str(marker), model_type="evil").encode(),
    }
    code = """
        import pytest
        from stem_hf.cli import main
        with pytest.raises(ValueError, match="holds a 'evil' config, not a STEM one"):
            main(["info", "user/evil"])
        for argv in (["info", "runs/x"], ["convert", "runs/x", "out"]):
            with pytest.raises(FileNotFoundError, match="runs/x: no such folder, nor a Hub repo"):
                main(argv)
    """
    with fake_hub(lifetime=300) as (endpoint, state):
        state.repos["user/evil"] = evil
        env = {
            **os.environ,
            **hub_env(endpoint),
            "HF_HOME": str(tmp_path / "hf-home"),
            "HF_MODULES_CACHE": str(tmp_path / "modules"),
            "PYTHONPATH": ROOT,
        }
        run = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=tmp_path, capture_output=True, text=True
        )
        requested = list(state.requests)
    assert run.returncode == 0, run.stderr[-3000:]
    assert not marker.exists()
    assert not [r for r in requested if "evil_code.py" in r]


# eval checks its output before loading, and prints its results even when writing them fails.


@pytest.mark.parametrize("where", ["under_a_file", "read_only_folder"])
def test_eval_refuses_an_unwritable_output_before_loading(tmp_path, where):
    checkpoint = tmp_path / "stem"
    tiny_model(vocab_size=BYTE_VOCAB).config.save_pretrained(checkpoint)  # no weights: loading would fail otherwise
    byte_tokenizer().save_pretrained(checkpoint)
    if where == "under_a_file":  # unwritable for root too
        (tmp_path / "a_file").write_text("")
        output = tmp_path / "a_file" / "results.json"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only folder; the case under a file covers root")
        (tmp_path / "read-only").mkdir(mode=0o555)
        output = tmp_path / "read-only" / "results.json"
    with pytest.raises(OSError, match="--output: cannot write"):
        main(["eval", str(checkpoint), "--tasks", "stem_facts", "--output", str(output)])
    (tmp_path / "old.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="is not a results file"):
        main(["eval", str(checkpoint), "--tasks", "stem_facts", "--output", str(tmp_path / "old.json")])


TASK_YAML = """task: vanishing_folder
custom_dataset: !function vanishing.docs
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
TASK_CODE = """import os
import shutil

def docs(**kwargs):
    import datasets

    if os.path.isdir({folder!r}):  # the output folder goes away while the evaluation runs
        shutil.rmtree({folder!r})
        open({folder!r}, "w").close()
    rows = [{{"question": "One plus one?", "choices": ["two", "three"], "answer": 0}}] * 3
    return {{"test": datasets.Dataset.from_list(rows)}}
"""


@pytest.mark.slow
def test_eval_prints_its_results_when_writing_them_fails(tmp_path, capsys):
    checkpoint = tmp_path / "stem"
    tiny_model(vocab_size=BYTE_VOCAB, max_position_embeddings=128).save_pretrained(checkpoint)
    byte_tokenizer().save_pretrained(checkpoint)
    folder = tmp_path / "results"
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "vanishing.yaml").write_text(TASK_YAML)
    (tasks / "vanishing.py").write_text(TASK_CODE.format(folder=str(folder)))
    output = folder / "results.json"
    argv = ["eval", str(checkpoint), "--tasks", "vanishing_folder", "--include-path", str(tasks)]
    with pytest.raises(SystemExit, match=f"could not write the results to {output}"):
        main([*argv, "--output", str(output)])
    assert folder.is_file()  # the write really failed
    printed = capsys.readouterr().out
    assert printed.startswith("vanishing_folder") and "acc " in printed
    results = json.loads(printed[printed.index("\n{") :])
    assert results["n-samples"]["vanishing_folder"]["effective"] == 3
    assert 0.0 <= results["results"]["vanishing_folder"]["acc,none"] <= 1.0


# A missing local folder is named as such, not reported as a bad Hub repo id.


@pytest.mark.parametrize("command", ["convert", "card", "push", "edit", "analyze", "info", "eval"])
@pytest.mark.parametrize("missing", ["./no/such/dir", "no/such/dir", "/no/such", "~/no-such"])
def test_a_missing_local_folder_is_named_as_such(tmp_path, monkeypatch, command, missing):
    monkeypatch.chdir(tmp_path)
    argv = {
        "convert": ["convert", missing, "out", *NO_TEXT],
        "card": ["card", missing],
        "push": ["push", missing, "user/repo"],
        "edit": ["edit", missing, "--source", " a", "--target", " b", "--prompt", "a b"],
        "analyze": ["analyze", missing],
        "info": ["info", missing],
        "eval": ["eval", missing, "--tasks", "stem_facts"],
    }[command]
    with pytest.raises(FileNotFoundError, match=re.escape(f"{missing}: no such folder")):
        main(argv)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["card", "push"])
def test_card_and_push_take_only_local_folders(tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="runs/x: no such folder"):
        main([command, "runs/x"] + (["user/repo"] if command == "push" else []))


# A source without a tokenizer: the CLI says which of its options to use, and --tokenizer supplies one.


def test_convert_without_a_source_tokenizer_names_the_cli_options_before_loading(tmp_path):
    _dense_source(tmp_path / "src", weights=False, tokenizer=False)
    with pytest.raises(ValueError) as error:
        main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), *_text_files(tmp_path)])
    message = str(error.value)
    assert "has no tokenizer" in message and "--calibration files" in message
    assert "--tokenizer PATH_OR_ID" in message and "--init projected (or xavier) --refit none" in message
    assert "pass `tokenizer=`" not in message


def test_convert_takes_a_tokenizer_from_the_tokenizer_option(tmp_path, capsys):
    _dense_source(tmp_path / "src", tokenizer=False)
    _word_tokenizer().save_pretrained(tmp_path / "tok")
    files = _text_files(tmp_path)
    main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--tokenizer", str(tmp_path / "tok"), *files,
          "--init", "mean", "--stem-layers", "1", "--calibration-tokens", "200"])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["calibration_tokens"] == 200 and report["heldout_perplexity_stem"] > 1
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    byte = tmp_path / "byte"
    byte_tokenizer().save_pretrained(byte)  # 259 tokens: not this 64-token model's
    with pytest.raises(ValueError, match="259 tokens do not fit the source's vocabulary of 64"):
        main(["convert", str(tmp_path / "src"), str(tmp_path / "out2"), "--tokenizer", str(byte), *files])


# edit refuses a prompt with no token before the model loads.


def test_edit_refuses_an_empty_prompt_before_loading(tmp_path):
    checkpoint = tmp_path / "stem"
    tiny_model(vocab_size=SHAPE["vocab_size"]).config.save_pretrained(checkpoint)  # no weights
    tokenizer = _word_tokenizer()  # whitespace splits words: blanks are no token at all
    tokenizer.save_pretrained(checkpoint)
    edit = ["edit", str(checkpoint), "--source", "w5", "--target", "w6", "--prompt"]
    with pytest.raises(ValueError, match="--prompt: empty"):
        main([*edit, ""])
    with pytest.raises(ValueError, match="--prompt: '   ' tokenizes to no token"):
        main([*edit, "   "])
    with pytest.raises(ValueError, match="the source string ' ' is empty"):
        main(["edit", str(checkpoint), "--source", " ", "--target", "w6", "--prompt", "w5 w7"])
