"""Runs the notebooks in place so that the committed files hold the outputs of a real run:
`.venv/bin/python notebooks/run.py [NAME.ipynb ...]` (default: all), from the repository root. With
`STEM_NOTEBOOK_TINY=1` they run on tiny random models (what `tests/test_notebooks.py` does) and are not saved."""

import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent


def run(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=1800, resources={"metadata": {"path": str(HERE.parent)}}).execute()
    if os.environ.get("STEM_NOTEBOOK_TINY") != "1":
        nbformat.write(notebook, path)


if __name__ == "__main__":
    for name in sys.argv[1:] or sorted(p.name for p in HERE.glob("*.ipynb")):
        run(HERE / name)
        print(name)
