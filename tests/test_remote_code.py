"""A saved STEM checkpoint carries its own code: it loads with trust_remote_code where stem_hf cannot be imported."""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

import stem_hf
from stem_hf import StemForCausalLM
from stem_hf.remote_check import load_without_package
from tests.conftest import TINY, tiny_model


def test_save_pretrained_writes_auto_map_and_flat_code(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_stem.StemConfig",
        "AutoModelForCausalLM": "modeling_stem.StemForCausalLM",
    }
    assert config["architectures"] == ["StemForCausalLM"]
    assert {"configuration_stem.py", "modeling_stem.py"} <= {p.name for p in tmp_path.iterdir()}


def test_remote_code_only_imports_torch_and_transformers():
    package = os.path.dirname(stem_hf.__file__)
    for name in ("configuration_stem.py", "modeling_stem.py"):
        for line in open(os.path.join(package, name)):
            if line.startswith(("import ", "from ")):
                module = line.split()[1]
                assert module.split(".")[0] in ("torch", "transformers", "math", "collections") or (
                    module.startswith(".") and not module.startswith("..") and "." not in module[1:]
                ), f"{name}: {line.strip()}"


def test_loads_with_trust_remote_code_without_the_package(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    input_ids = torch.randint(3, TINY["vocab_size"], (2, 6))
    out = load_without_package(tmp_path, input_ids, max_new_tokens=4)
    assert out["module"].startswith("transformers_modules"), out["module"]
    with torch.no_grad():
        assert torch.equal(out["logits"], model(input_ids).logits)
        assert torch.equal(out["generated"], model.generate(input_ids, max_new_tokens=4, do_sample=False))


def test_blocked_load_really_cannot_import_the_package(tmp_path):
    # The check itself must fail when the copied code is missing, or it proves nothing.
    tiny_model().save_pretrained(tmp_path)
    (tmp_path / "modeling_stem.py").unlink()
    with pytest.raises(RuntimeError, match="without stem_hf failed"):
        load_without_package(tmp_path, torch.tensor([[3, 4]]))


def test_loads_through_auto_class_with_package_imported(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # registered at import: no trust_remote_code
    assert type(reloaded) is StemForCausalLM
    input_ids = torch.randint(0, TINY["vocab_size"], (1, 5))
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, reloaded(input_ids).logits)
