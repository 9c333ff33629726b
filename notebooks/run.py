"""Runs the notebooks in place so that the committed files hold the outputs of a real run:
`.venv/bin/python notebooks/run.py [NAME.ipynb ...]` (default: all), from the repository root. With
`STEM_NOTEBOOK_TINY=1` they run on tiny random models (what `tests/test_notebooks.py` does) and are not saved."""

import os
import re
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent


def squash_streams(notebook) -> None:
    """Merges each cell's consecutive stdout (or stderr) outputs and keeps what a terminal would show of them: a
    progress bar redraws its line with a carriage return, and only its last state is worth committing."""
    for cell in (c for c in notebook.cells if c.cell_type == "code"):
        merged = []
        for output in cell.outputs:
            if output.output_type == "stream" and merged and merged[-1].get("name") == output.name:
                merged[-1].text += output.text
            else:
                merged.append(output)
        for output in merged:
            if output.output_type == "stream":
                output.text = "\n".join(re.sub(r"^.*\r(?=[^\r])", "", line) for line in output.text.split("\n"))
        cell.outputs = merged


def run(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=1800, resources={"metadata": {"path": str(HERE.parent)}}).execute()
    if os.environ.get("STEM_NOTEBOOK_TINY") != "1":
        squash_streams(notebook)
        nbformat.write(notebook, path)


if __name__ == "__main__":
    for name in sys.argv[1:] or sorted(p.name for p in HERE.glob("*.ipynb")):
        run(HERE / name)
        print(name)
