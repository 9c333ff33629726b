"""STEM checkpoints on the Hub. `push_checkpoint` (`stem-hf push`) uploads a saved folder as it is (config, copied code,
dense and table shards, tokenizer, model card, conversion report, evaluation results) after checking that it loads;
`push_model` is `model.push_to_hub` for a model in memory."""

import json
import os
import shutil
import tempfile
from pathlib import Path

from huggingface_hub import CommitInfo, HfApi
from huggingface_hub.errors import HfHubHTTPError
from transformers.utils import logging
from transformers.utils.hub import create_and_tag_model_card

from .accounting import STORE_NAME, check_local, load_config
from .checkpoint_stem import (
    PROVENANCE_FILES,
    SAVE_ID_KEY,
    check_checkpoint_files,
    read_save_id,
    reading_checkpoint,
    write_card,
)
from .model_card import CARD_FILE, MARKER, stale_provenance, write_model_card

logger = logging.get_logger(__name__)

# Hidden files, temporary files and evaluation results set aside for other weights never go up.
# The offload store duplicates the tables token-major for serving on this host; `stem-hf offload-store` rebuilds it.
IGNORE = [".*", "*.tmp", "*.partial", "lm_eval_results.*.json", STORE_NAME]
WEIGHT_FILES = ["*.safetensors", "*.safetensors.index.json", "*.bin"]


def push_checkpoint(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
) -> str:
    """Checks the checkpoint in `folder` (every shard and table present and whole, shapes as the config says), refreshes
    a stem-hf model card with `repo_id` in its usage snippet, creates the repo if needed, and uploads the folder in one
    commit that also deletes weight files of an earlier push that the folder no longer has. A card on the Hub that a
    person wrote is kept. Returns the commit URL."""
    folder = Path(folder)
    check_local(str(folder), hub=False)  # a missing folder is named as such, not tried as a repo id
    with reading_checkpoint(folder):  # a save into the folder waits until the upload has read every file
        return _push_folder(folder, repo_id, private, revision, commit_message, token)


def _push_folder(
    folder: Path,
    repo_id: str,
    private: bool | None,
    revision: str | None,
    commit_message: str | None,
    token: str | None,
) -> str:
    check_checkpoint_files(str(folder), load_config(str(folder), hub=False))
    if not any(folder.glob("tokenizer*")):
        raise ValueError(f"{folder} has no tokenizer: save one there (tokenizer.save_pretrained) before pushing")
    write_model_card(folder, repo_id=repo_id)
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    if revision is not None:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    # Provenance of weights saved over since describes other weights: it stays in the folder, not on the Hub.
    stale = stale_provenance(folder, PROVENANCE_FILES)
    ignore = [*IGNORE, *stale]
    if api.file_exists(repo_id, CARD_FILE, revision=revision):
        card = Path(api.hf_hub_download(repo_id, CARD_FILE, revision=revision)).read_text(encoding="utf-8")
        if MARKER not in card:  # a person wrote or edited the card on the Hub: keep it, as push_to_hub does
            ignore.append(CARD_FILE)
    commit = api.upload_folder(
        repo_id=repo_id,
        folder_path=folder,
        revision=revision,
        commit_message=commit_message or f"Upload STEM checkpoint {folder.resolve().name}",
        ignore_patterns=ignore,
        # Weight files of an earlier push that this checkpoint no longer has (fewer shards) would be orphans.
        delete_patterns=[*WEIGHT_FILES, *stale],  # stale provenance an earlier push put up goes too
    )
    return commit.commit_url


def _carry_provenance(model, loaded_id: str | None, tmp: str, fetch, on_hub: dict) -> None:
    """Puts next to the pushed weights the provenance files of the folder `model` was loaded from, re-stamped with the
    pushed save id when they describe the loaded weights; else keeps the repo's. A refreshed card then never says less
    than the one it replaces."""
    pushed_id = read_save_id(tmp)
    for name in PROVENANCE_FILES:
        local = os.path.join(model.name_or_path or "", name)
        if model.name_or_path and os.path.isfile(local):
            try:
                with open(local, encoding="utf-8") as f:
                    record = json.load(f)
            except ValueError:  # copied as it is: the card says what is wrong with it
                record = None
            if not isinstance(record, dict) or record.get(SAVE_ID_KEY) is None:
                shutil.copy(local, os.path.join(tmp, name))  # tied to no save
            elif record[SAVE_ID_KEY] != loaded_id:
                logger.warning(f"{local} describes other weights than the ones this model was loaded from: not pushed")
            else:  # it describes the loaded weights, which are what this push uploads under a new save id
                with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                    json.dump({**record, SAVE_ID_KEY: pushed_id}, f, indent=2)
        elif on_hub[name]:
            fetch(name)


def push_model(
    model,
    repo_id: str,
    *,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: bool | str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    max_shard_size: int | str | None = "50GB",
    tags: list[str] | None = None,
) -> CommitInfo:
    """`model.push_to_hub` for a STEM model: uploads what `save_pretrained` writes (config, copied code, dense and table
    shards) and the stem-hf model card, with `repo_id` in its usage snippet. A card on the Hub that a person wrote is
    kept, its tags updated, as transformers does; a card stem-hf generated is refreshed. `tags` go to the card only.
    The tokenizer is pushed on its own (`tokenizer.push_to_hub`), or with the whole folder by `stem-hf push`. Returns
    the commit's `CommitInfo`, as transformers' `push_to_hub` does."""
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    with tempfile.TemporaryDirectory() as root:
        tmp = os.path.join(root, "upload")

        def fetch(name: str) -> None:  # hf_hub_download leaves a .cache folder in local_dir: not in the upload
            path = api.hf_hub_download(repo_id, name, revision=revision, local_dir=root)
            shutil.copy(path, os.path.join(tmp, name))

        loaded_id = getattr(model, "stem_save_id", None)
        model.save_pretrained(tmp, max_shard_size=max_shard_size)  # gives the model the pushed files' save id
        on_hub = {name: api.file_exists(repo_id, name, revision=revision) for name in (CARD_FILE, *PROVENANCE_FILES)}
        _carry_provenance(model, loaded_id, tmp, fetch, on_hub)
        if on_hub[CARD_FILE] and revision is not None:
            fetch(CARD_FILE)
        elif on_hub[CARD_FILE] or getattr(model, "_model_card_writer", None) is None:
            all_tags = [*(model.model_tags or []), *(tags or [])]
            create_and_tag_model_card(repo_id, all_tags, token=token).save(os.path.join(tmp, CARD_FILE))
        write_card(model, tmp, repo_id, tags)
        _create_branch(api, repo_id, revision, create_pr)
        name = type(model).__name__
        return api.upload_folder(  # transformers' default message, as its push_to_hub writes it
            repo_id=repo_id,
            folder_path=tmp,
            revision=revision,
            commit_message=commit_message or ("Upload model" if "Model" in name else f"Upload {name}"),
            commit_description=commit_description,
            create_pr=create_pr,
        )


def _create_branch(api: HfApi, repo_id: str, revision: str | None, create_pr: bool) -> None:
    """Creates `revision` if missing; a pull request may target a branch it cannot create, as transformers allows."""
    if revision is None or revision.startswith("refs/pr"):
        return
    try:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    except HfHubHTTPError as error:
        if not (create_pr and error.response is not None and error.response.status_code == 403):
            raise


__all__ = ["push_checkpoint", "push_model"]
