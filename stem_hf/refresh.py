"""`stem-hf refresh-code`: replaces the model code a STEM checkpoint carries (the files `save_pretrained` copies next to
the weights) with this package's, in a local folder or a Hub repo, and records the transformers range that code is
tested with in the checkpoint's config.json.

A checkpoint's code runs under whatever transformers its user has installed: code saved for transformers before 5.24
passes the KV cache as `past_key_values`, which 5.24 renamed `cache`, and generates other tokens there. Refreshing the
code fixes the checkpoint without touching its weights. The checkpoint's own code never runs here: its config.json is
read as plain JSON.
"""

import contextlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
from transformers.dynamic_module_utils import get_relative_import_files

from . import StemConfig, StemForCausalLM, StemModel, __version__
from .accounting import check_local, check_stem
from .checkpoint_stem import CONFIG_NAME, commit_lock
from .compat_stem import SUPPORTED_TRANSFORMERS, parse_range

RANGE_KEY = "supported_transformers"
# What `save_pretrained` of a STEM model writes into `auto_map`: a config without it holds no stem-hf code to refresh.
AUTO_MAP = {"AutoConfig": "configuration_stem.StemConfig", "AutoModelForCausalLM": "modeling_stem.StemForCausalLM"}
LAST_CODE = "modeling_stem.py"  # the module transformers loads first; it imports the others
# Code files an older stem-hf saved that this one does not (storage_stem.py became checkpoint_stem.py, its tables moving
# into modeling_stem.py): a refresh removes them, after the new code is in place.
OBSOLETE_CODE = ("storage_stem.py",)
TEMP_PREFIX = ".stem-refresh-"  # hidden and `.tmp`: `stem-hf push` never uploads one left by a killed refresh


@dataclass(frozen=True)
class RefreshResult:
    """What `refresh_code` found: `changed` names the files that differed from this package's (replaced, unless
    `check_only`) and the obsolete code files present (`OBSOLETE_CODE`, removed unless `check_only`); `commit_url` is
    the Hub commit or pull request that replaced them (None for a folder, a check, or a repo already up to date)."""

    target: str
    changed: tuple[str, ...]
    check_only: bool
    commit_url: str | None = None


def code_files() -> dict[str, Path]:
    """The remote-code files `save_pretrained` copies, by its rule (transformers' `custom_object_save`): the module file
    of each class registered for an Auto class, and the files it imports relatively, recursively. Keyed by file name."""
    files = {}
    for cls in (StemConfig, StemModel, StemForCausalLM):
        module_file = Path(sys.modules[cls.__module__].__file__)
        for path in (module_file, *map(Path, get_relative_import_files(module_file))):
            files[path.name] = path
    return dict(sorted(files.items()))


def refresh_code(
    target: str | os.PathLike,
    *,
    check_only: bool = False,
    revision: str | None = None,
    create_pr: bool = False,
    token: str | None = None,
    force: bool = False,
) -> RefreshResult:
    """Replaces the code files of the STEM checkpoint `target` (a folder, or else a Hub repo id) with this package's
    and sets `supported_transformers` in its config.json; everything else in the config and the folder is kept. Files
    already equal are not written. Refuses, before writing anything, a target that is not a STEM checkpoint saved by
    stem-hf (config.json with model_type "stem" and an `auto_map` naming its code). A folder's files are replaced each
    by an atomic rename; a Hub repo gets one commit (on `revision`, or a pull request with `create_pr`), made on the
    commit its files were read at, so that it fails rather than undo a commit pushed meanwhile. `check_only`: only say
    which files differ. Code recorded for a newer transformers range than this package's (a newer stem-hf saved it) is
    refused unless `force`: replacing it would be a downgrade. Hand edits to the code files are replaced."""
    target = os.fspath(target)
    if check_local(target):
        if revision is not None or create_pr:
            raise ValueError(f"{target} is a local path: a revision and a pull request are for a Hub repo")
        return _refresh_folder(Path(target), check_only, force)
    return _refresh_repo(target, check_only, revision, create_pr, token, force)


# Checks --------------------------------------------------------------------------------------------------------


def _check_not_newer(config: dict, where: str) -> None:
    """Raises if the checkpoint's recorded range reaches past this code's (a range not of the usual form counts as
    older)."""
    recorded = config.get(RANGE_KEY)
    recorded_upper = (parse_range(recorded) or ((0, 0), (0, 0)))[1]
    if recorded_upper > parse_range(SUPPORTED_TRANSFORMERS)[1]:
        raise ValueError(
            f"{where}: its code was saved for transformers{recorded}, newer than this stem-hf's "
            f"(transformers{SUPPORTED_TRANSFORMERS}): refreshing would replace it with older code. Upgrade stem-hf, or "
            "pass force=True (`--force`) to replace it anyway"
        )


def _check_config(config: object, where: str) -> dict:
    """`config` (parsed config.json) if it is that of a STEM checkpoint stem-hf saved with its code; else raises."""
    if not isinstance(config, dict):
        raise ValueError(f"{where}: {CONFIG_NAME} is not a JSON object")
    if config.get("model_type") != StemConfig.model_type:
        raise ValueError(f"{where} holds a {config.get('model_type')!r} config, not a STEM one (model_type 'stem')")
    auto_map = config.get("auto_map")
    if not isinstance(auto_map, dict) or any(auto_map.get(k) != v for k, v in AUTO_MAP.items()):
        raise ValueError(
            f"{where}: its {CONFIG_NAME} has auto_map {auto_map!r}, not one pointing at the code stem-hf saves "
            f"({AUTO_MAP}): not a STEM checkpoint that carries stem-hf's code, so there is no code to refresh"
        )
    return config


def _new_files(config: dict) -> dict[str, bytes]:
    """Every code file's new bytes, and config.json's where its recorded range is not this code's."""
    files = {name: path.read_bytes() for name, path in code_files().items()}
    if config.get(RANGE_KEY) != SUPPORTED_TRANSFORMERS:
        # As transformers writes a config (`PreTrainedConfig.to_json_string`): every other key kept, stem_save_id too.
        text = json.dumps({**config, RANGE_KEY: SUPPORTED_TRANSFORMERS}, indent=2, sort_keys=True) + "\n"
        files[CONFIG_NAME] = text.encode("utf-8")
    return files


# A local folder ------------------------------------------------------------------------------------------------


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.exists() else None


def _refresh_folder(folder: Path, check_only: bool, force: bool) -> RefreshResult:
    check_stem(str(folder), hub=False)  # a folder with a readable config.json, model_type "stem"
    config = _check_config(json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8")), str(folder))
    if not force:
        _check_not_newer(config, str(folder))
    files = _new_files(config)
    before = {name: _read(folder / name) for name in files}
    changes = {name: data for name, data in files.items() if before[name] != data}
    obsolete = [name for name in OBSOLETE_CODE if (folder / name).exists()]
    if (changes or obsolete) and not check_only:
        _replace_files(folder, changes, before, obsolete)
    return RefreshResult(str(folder), tuple(sorted([*changes, *obsolete])), check_only)


def _rename_order(changes: dict[str, bytes], before: dict[str, bytes | None]) -> list[str]:
    """Files the old code does not import first, the other code files, modeling_stem.py (which transformers loads and
    which imports them) last of the code, then config.json, whose range then describes code that is all in place. A
    crash between renames leaves old modeling code with new files it does not import, or with new versions of the
    files it imports that keep every name it takes from them; running the refresh again finishes the job."""
    rank = {CONFIG_NAME: 3, LAST_CODE: 2}
    return sorted(changes, key=lambda name: (rank.get(name, 1 if before[name] is not None else 0), name))


def _stage(folder: Path, name: str, data: bytes, mode: int) -> str:
    """Writes `data` to a temporary file in `folder` (same filesystem as `name`, so that the rename is atomic), flushed
    to disk, with `mode`. Returns its path; removes it if anything fails."""
    fd, temp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temp, mode)
    except BaseException:
        os.remove(temp)
        raise
    return temp


def _replace_files(
    folder: Path, changes: dict[str, bytes], before: dict[str, bytes | None], obsolete: list[str]
) -> None:
    """Stages every new file, then renames each into place in `_rename_order` and removes the `obsolete` code files
    (which the new code no longer imports); removes what it staged if anything fails.

    The renames hold the folder's commit lock (`checkpoint_stem.commit_lock`), as a save's do: loads in progress finish
    first and loads that start meanwhile wait, so none reads old code with a new config. A file that changed since it
    was read (a save into the folder meanwhile) stops the refresh before its rename, so that an old config.json, with
    its save id, is not put back over a new save's."""
    order = _rename_order(changes, before)
    new_mode = os.stat(folder / CONFIG_NAME).st_mode & 0o777  # a new code file gets the config's permissions
    staged = {}
    try:
        for name in order:
            mode = os.stat(folder / name).st_mode & 0o777 if before[name] is not None else new_mode
            staged[name] = _stage(folder, name, changes[name], mode)
        with commit_lock(folder):
            for name in order:
                if _read(folder / name) != before[name]:
                    raise RuntimeError(f"{folder / name} changed while its code was refreshed (a save?); run it again")
                os.replace(staged.pop(name), folder / name)
            for name in obsolete:
                os.remove(folder / name)
            _fsync_folder(folder)
    finally:
        for temp in staged.values():
            with contextlib.suppress(FileNotFoundError):
                os.remove(temp)


def _fsync_folder(folder: Path) -> None:
    """Makes the renames durable (POSIX; folders cannot be opened for it elsewhere)."""
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# A Hub repo ----------------------------------------------------------------------------------------------------


def _hub_config(api: HfApi, repo_id: str, revision: str | None) -> dict:
    """The repo's config.json parsed as plain JSON and checked; the errors name what was tried."""
    try:
        path = api.hf_hub_download(repo_id, CONFIG_NAME, revision=revision)
    except (OSError, ValueError) as error:  # no repo, no file, offline, gated
        raise FileNotFoundError(
            f"{repo_id}: no such folder, nor a Hub repo whose {CONFIG_NAME} could be read ({type(error).__name__}: "
            f"{error})"
        ) from error
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{repo_id}: not a readable {CONFIG_NAME} ({error})") from error
    return _check_config(config, repo_id)


def _refresh_repo(
    repo_id: str, check_only: bool, revision: str | None, create_pr: bool, token: str | None, force: bool
) -> RefreshResult:
    api = HfApi(token=token)
    try:
        head = api.repo_info(repo_id, revision=revision)  # one commit: every file is read at it, the commit made on it
    except (OSError, ValueError) as error:  # no repo, no revision, offline, gated
        raise FileNotFoundError(
            f"{repo_id}: no such folder, nor a Hub repo that could be read ({type(error).__name__}: {error})"
        ) from error
    config = _hub_config(api, repo_id, head.sha)
    if not force:
        _check_not_newer(config, repo_id)
    files = _new_files(config)
    present = {sibling.rfilename for sibling in head.siblings or []}
    obsolete = [name for name in OBSOLETE_CODE if name in present]
    changed = tuple(
        name
        for name, data in files.items()
        if name not in present or Path(api.hf_hub_download(repo_id, name, revision=head.sha)).read_bytes() != data
    ) + tuple(obsolete)
    if check_only or not changed:
        return RefreshResult(repo_id, changed, check_only)
    # Every code file, so that the repo's code is this package's as a whole; unchanged ones are no-ops.
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=data) for name, data in files.items()]
    commit = api.create_commit(
        repo_id,
        operations + [CommitOperationDelete(path_in_repo=name) for name in obsolete],
        commit_message=f"Refresh STEM model code for transformers{SUPPORTED_TRANSFORMERS} (stem-hf {__version__})",
        commit_description="Replaced: " + ", ".join(changed),
        revision=revision,
        create_pr=create_pr,
        parent_commit=head.sha,
    )
    return RefreshResult(repo_id, changed, check_only, commit.pr_url or commit.commit_url)


__all__ = ["RefreshResult", "code_files", "refresh_code"]
