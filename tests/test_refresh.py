"""`stem-hf refresh-code` on a checkpoint saved under transformers 5.23 with the code of then (`past_key_values`): after
the refresh, a load without stem_hf gives the saved logits and greedy tokens under the installed transformers; before
it, 5.24 generates other tokens. Refusals happen before any write, a failed write leaves the folder as it was, a second
refresh changes nothing, and a Hub repo is refreshed in one commit."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from stem_hf import StemForCausalLM
from stem_hf.cli import main
from stem_hf.compat_stem import SUPPORTED_TRANSFORMERS
from stem_hf.refresh import OBSOLETE_CODE, TEMP_PREFIX, code_files, refresh_code
from stem_hf.remote_check import load_without_package
from tests.conftest import tiny_model
from tests.fake_hub import fake_hub, hub_env, run_against_hub

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "saved-5.23"
REFERENCE = load_file(DATA / "reference.safetensors")
PROMPTS, GREEDY = REFERENCE["prompts"], REFERENCE["greedy"]
NEW_TOKENS = GREEDY.shape[1] - PROMPTS.shape[1]
MINOR = tuple(int(part) for part in transformers.__version__.split(".")[:2])


@pytest.fixture
def folder(tmp_path) -> Path:
    """A copy of the checkpoint saved under 5.23, its code as it was then."""
    return Path(shutil.copytree(DATA / "checkpoint", tmp_path / "checkpoint"))


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def _stale(folder: Path) -> set[str]:
    """The files a refresh of `folder` should replace or remove: code files that differ from the package's, obsolete
    ones (storage_stem.py, renamed checkpoint_stem.py), and config.json."""
    differ = {
        n for n, p in code_files().items() if not (folder / n).exists() or (folder / n).read_bytes() != p.read_bytes()
    }
    return differ | {n for n in OBSOLETE_CODE if (folder / n).exists()} | {"config.json"}


def test_code_files_are_the_files_save_pretrained_copies(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    saved = {p.name: p.read_bytes() for p in tmp_path.glob("*.py")}
    assert (
        set(code_files())
        == set(saved)
        == {"compat_stem.py", "configuration_stem.py", "modeling_stem.py", "checkpoint_stem.py"}
    )
    assert all(path.read_bytes() == saved[name] for name, path in code_files().items())


@pytest.mark.slow
def test_a_refreshed_5_23_checkpoint_gives_its_saved_logits_and_tokens_without_the_package(folder):
    weights = {n: v for n, v in _snapshot(folder).items() if not n.endswith((".py", "config.json"))}
    old_config = (folder / "config.json").read_text()
    result = refresh_code(folder)
    assert set(result.changed) == _stale(DATA / "checkpoint") and result.commit_url is None
    assert {n: v for n, v in _snapshot(folder).items() if n in weights} == weights  # weights, card: not touched
    assert all((folder / n).read_bytes() == p.read_bytes() for n, p in code_files().items())
    assert "storage_stem.py" in result.changed and not (folder / "storage_stem.py").exists()  # 5.23's, now unused
    # config.json as transformers writes it, only the range changed: its save id still matches the weights'.
    old_range = json.loads(old_config)["supported_transformers"]
    assert (folder / "config.json").read_text() == old_config.replace(old_range, SUPPORTED_TRANSFORMERS)
    assert not list(folder.glob(TEMP_PREFIX + "*"))

    remote = load_without_package(folder, PROMPTS, max_new_tokens=NEW_TOKENS)
    assert remote["module"].startswith("transformers_modules")
    assert torch.equal(remote["logits"], REFERENCE["logits"])
    assert torch.equal(remote["generated"], GREEDY)
    with torch.no_grad():  # and the package's own load, which checks config and weights belong to one save
        assert torch.equal(StemForCausalLM.from_pretrained(folder).eval()(PROMPTS).logits, REFERENCE["logits"])


@pytest.mark.skipif(
    MINOR < (5, 24), reason="transformers before 5.24 passes `past_key_values`, which the old code takes"
)
@pytest.mark.slow
def test_under_5_24_the_unrefreshed_checkpoint_generates_other_tokens(folder):
    remote = load_without_package(folder, PROMPTS, max_new_tokens=NEW_TOKENS)
    assert remote["generated"].shape == GREEDY.shape
    assert not torch.equal(remote["generated"], GREEDY)


@pytest.mark.slow
def test_a_refresh_cut_before_modeling_stem_py_leaves_a_checkpoint_that_loads(folder):
    """The state a crash after every rename but modeling_stem.py's leaves: old modeling code, new files around it."""
    for name, path in code_files().items():
        if name != "modeling_stem.py":
            shutil.copyfile(path, folder / name)
    remote = load_without_package(folder, PROMPTS, max_new_tokens=NEW_TOKENS)
    assert torch.equal(remote["logits"], REFERENCE["logits"])
    if MINOR < (5, 24):
        assert torch.equal(remote["generated"], GREEDY)
    # Running it again finishes: modeling_stem.py, config.json, and 5.23's storage_stem.py, which no file imports now.
    assert set(refresh_code(folder).changed) == {"modeling_stem.py", "config.json", "storage_stem.py"}


def _without_auto_map(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "auto_map"}


def _auto_map_elsewhere(config: dict) -> dict:
    return {**config, "auto_map": {**config["auto_map"], "AutoModelForCausalLM": "org/repo--modeling_x.XForCausalLM"}}


@pytest.mark.parametrize(
    "edit, error, match",
    [
        (lambda c: {**c, "model_type": "llama"}, ValueError, "'llama' config, not a STEM one"),
        (_without_auto_map, ValueError, "auto_map None, not one pointing at the code stem-hf saves"),
        (_auto_map_elsewhere, ValueError, "not one pointing at the code stem-hf saves"),
    ],
    ids=["llama", "no-auto-map", "auto-map-elsewhere"],
)
def test_a_folder_that_is_not_a_stem_hf_checkpoint_is_refused_before_any_write(folder, edit, error, match):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(edit(config), indent=2))
    before = _snapshot(folder)
    with pytest.raises(error, match=match):
        refresh_code(folder)
    with pytest.raises(error, match=match):
        main(["refresh-code", str(folder), "--check"])
    assert _snapshot(folder) == before


def test_what_is_not_a_folder_is_refused(tmp_path, folder):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        refresh_code(tmp_path / "missing")
    with pytest.raises(NotADirectoryError, match="is a file, not a checkpoint folder"):
        refresh_code(folder / "config.json")
    (folder / "config.json").unlink()
    before = _snapshot(folder)
    with pytest.raises(FileNotFoundError, match="holds no config.json"):
        refresh_code(folder)
    with pytest.raises(ValueError, match="is a local path: a revision and a pull request are for a Hub repo"):
        refresh_code(folder, revision="main")
    assert _snapshot(folder) == before


def test_check_exits_1_until_the_refresh_and_a_second_refresh_changes_nothing(folder, capsys):
    before = _snapshot(folder)
    with pytest.raises(SystemExit) as exit:
        main(["refresh-code", str(folder), "--check"])
    assert exit.value.code == 1
    out = capsys.readouterr().out
    assert "differs from this stem-hf's code in checkpoint_stem.py, compat_stem.py, config.json" in out
    assert _snapshot(folder) == before
    main(["refresh-code", str(folder)])
    assert "replaced checkpoint_stem.py, compat_stem.py" in capsys.readouterr().out
    refreshed = _snapshot(folder)
    assert refresh_code(folder).changed == ()
    main(["refresh-code", str(folder), "--check"])  # returns: exit status 0
    assert "nothing to change" in capsys.readouterr().out
    assert _snapshot(folder) == refreshed  # not even rewritten with the same bytes


@pytest.mark.slow
def test_a_write_that_fails_leaves_the_old_files_and_no_temporary_file(folder):
    """A real failure: a file-size limit lets the small new files be staged and refuses modeling_stem.py."""
    sizes = {name: path.stat().st_size for name, path in code_files().items()}
    limit = sizes["modeling_stem.py"] - 1
    assert max(sizes["compat_stem.py"], sizes["configuration_stem.py"]) < limit  # staged before it, and fit
    code = f"""
        import resource
        from stem_hf.refresh import refresh_code
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY))
        try:
            refresh_code({str(folder)!r})
        except OSError as error:
            print("refused:", error)
    """
    before = _snapshot(folder)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "refused: [Errno 27] File too large" in run.stdout
    assert _snapshot(folder) == before  # no compat_stem.py, no temporary file, every old file as it was


@pytest.mark.slow
def test_a_hub_repo_is_refreshed_in_one_commit_and_then_loads_with_the_saved_tokens(tmp_path):
    with fake_hub(lifetime=300) as (endpoint, hub):
        env = hub_env(endpoint)
        upload = f"""
            from huggingface_hub import HfApi
            api = HfApi()
            api.create_repo("user/stem-523")
            api.upload_folder(repo_id="user/stem-523", folder_path={str(DATA / "checkpoint")!r})
        """
        run_against_hub(upload, env, tmp_path)
        assert len(hub.commits["user/stem-523"]) == 1
        out = run_against_hub(REFRESH_REPO, env, tmp_path)
        codes = [line for line in out.splitlines() if line.startswith(("check ", "refresh "))]
        assert codes == ["check 1", "refresh None", "check None"], out
        assert len(hub.commits["user/stem-523"]) == 2  # the refresh's one commit; the checks made none
        assert hub.messages["user/stem-523"][-1].startswith(
            f"Refresh STEM model code for transformers{SUPPORTED_TRANSFORMERS} (stem-hf "
        )
        files = hub.repos["user/stem-523"]
        assert all(files[n] == p.read_bytes() for n, p in code_files().items())
        config = json.loads(files["config.json"])
        old = json.loads((DATA / "checkpoint" / "config.json").read_text())
        assert config == {**old, "supported_transformers": SUPPORTED_TRANSFORMERS}

        remote = load_without_package("user/stem-523", PROMPTS, max_new_tokens=NEW_TOKENS, hub_env=env)
    assert torch.equal(remote["logits"], REFERENCE["logits"])
    assert torch.equal(remote["generated"], GREEDY)


@pytest.mark.slow
def test_a_hub_commit_pushed_meanwhile_makes_the_refresh_fail_instead_of_being_undone(tmp_path):
    with fake_hub(lifetime=300) as (endpoint, hub):
        env = hub_env(endpoint)
        race = f"""
            from huggingface_hub import CommitOperationAdd, HfApi
            from huggingface_hub.errors import HfHubHTTPError
            from stem_hf.refresh import refresh_code
            api = HfApi()
            api.create_repo("user/stem-523")
            api.upload_folder(repo_id="user/stem-523", folder_path={str(DATA / "checkpoint")!r})
            commit = HfApi.create_commit

            def someone_else_commits_first(self, *args, **kwargs):  # between the refresh's reads and its commit
                edit = [CommitOperationAdd("config.json", b'{{"edited": true}}')]
                commit(self, "user/stem-523", edit, commit_message="edit")
                return commit(self, *args, **kwargs)

            HfApi.create_commit = someone_else_commits_first
            try:
                refresh_code("user/stem-523")
            except HfHubHTTPError as error:
                print("refused", error.response.status_code)
        """
        out = run_against_hub(race, env, tmp_path)
        assert "refused 412" in out, out
        assert hub.repos["user/stem-523"]["config.json"] == b'{"edited": true}'  # the other commit stands
        assert "compat_stem.py" not in hub.repos["user/stem-523"]


def test_code_saved_for_a_newer_transformers_range_is_refused_unless_forced(folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "supported_transformers": ">=5.18,<5.40"}))
    before = _snapshot(folder)
    with pytest.raises(ValueError, match=r"saved for transformers>=5\.18,<5\.40, newer than this stem-hf's"):
        refresh_code(folder)
    with pytest.raises(ValueError, match="--force"):
        main(["refresh-code", str(folder)])
    assert _snapshot(folder) == before
    main(["refresh-code", str(folder), "--force"])
    assert json.loads((folder / "config.json").read_text())["supported_transformers"] == SUPPORTED_TRANSFORMERS


REFRESH_REPO = """
    from stem_hf.cli import main

    for argv in (["--check"], [], ["--check"]):
        try:
            code = main(["refresh-code", "user/stem-523", *argv])
        except SystemExit as exit:
            code = exit.code
        print("check" if argv else "refresh", code)
"""


def test_a_refresh_waits_for_a_load_in_progress_before_its_renames(folder):
    import threading

    from stem_hf.checkpoint_stem import reading_checkpoint

    before = _snapshot(folder)
    with reading_checkpoint(folder):  # a load of the folder in progress
        writer = threading.Thread(target=refresh_code, args=(str(folder),))
        writer.start()
        writer.join(timeout=2.0)
        staged_only = {k: v for k, v in _snapshot(folder).items() if not k.startswith(TEMP_PREFIX)}
        assert writer.is_alive() and staged_only == before, "the refresh renamed files under a load"
    writer.join()
    assert _stale(folder) == {"config.json"}  # every code file refreshed (config.json is always listed)
    assert refresh_code(str(folder)).changed == ()
