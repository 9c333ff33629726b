"""`stem-hf push`: uploads a saved STEM checkpoint folder as it is (config, copied code, dense and table shards,
tokenizer, model card, conversion report, evaluation results) after checking that it loads."""

import os
from pathlib import Path

from huggingface_hub import HfApi

from .accounting import load_config
from .model_card import write_model_card
from .storage_stem import check_checkpoint_files

# Hidden files (leftovers of an interrupted save, editor files) and temporary files never go up.
IGNORE = [".*", "*.tmp"]


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
    commit. Returns the commit URL."""
    folder = Path(folder)
    config = load_config(str(folder))
    check_checkpoint_files(str(folder), config.vocab_size, config.intermediate_size, config.stem_layers)
    if not any(folder.glob("tokenizer*")):
        raise ValueError(f"{folder} has no tokenizer: save one there (tokenizer.save_pretrained) before pushing")
    write_model_card(folder, repo_id=repo_id)
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    if revision is not None:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    commit = api.upload_folder(
        repo_id=repo_id,
        folder_path=folder,
        revision=revision,
        commit_message=commit_message or f"Upload STEM checkpoint {folder.resolve().name}",
        ignore_patterns=IGNORE,
    )
    return commit.commit_url


__all__ = ["push_checkpoint"]
