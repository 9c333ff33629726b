"""Every committed notebook runs headlessly (nbclient) with tiny settings, so none can rot."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
@pytest.mark.slow
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("STEM_NOTEBOOK_TINY", "1")  # the kernel inherits it
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in notebook.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    assert os.listdir(tmp_path)  # it worked where it was told to
