"""Data loaders of the shipped offline lm-eval tasks. lm-eval resolves `!function stem_tasks.NAME` next to the YAML,
so the JSONL files are found from here, whatever the working directory."""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load(name: str):
    import datasets  # an lm-eval dependency

    with open(HERE / f"{name}.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}


def facts(**kwargs):
    return _load("facts")


def complete(**kwargs):
    return _load("complete")


def prose(**kwargs):
    return _load("prose")
