"""`stem-hf push`: uploads a saved STEM checkpoint folder as it is (config, copied code, dense and table shards,
tokenizer, model card, conversion report, evaluation results) after checking that it loads."""

import os
from pathlib import Path

from huggingface_hub import HfApi

from .accounting import load_config
from .model_card import MARKER, write_model_card
from .storage_stem import PROVENANCE_FILES, check_checkpoint_files, stale_provenance

# Hidden files, temporary files and evaluation results set aside for other weights never go up.
IGNORE = [".*", "*.tmp", "lm_eval_results.*.json"]
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
    config = load_config(str(folder), hub=False)  # a missing folder is named as such, not tried as a repo id
    check_checkpoint_files(str(folder), config.vocab_size, config.intermediate_size, config.stem_layers)
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
    if api.file_exists(repo_id, "README.md", revision=revision):
        card = Path(api.hf_hub_download(repo_id, "README.md", revision=revision)).read_text(encoding="utf-8")
        if MARKER not in card:  # a person wrote or edited the card on the Hub: keep it, as push_to_hub does
            ignore.append("README.md")
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


__all__ = ["push_checkpoint"]
