"""A saved STEM checkpoint carries its own code: it loads with trust_remote_code where stem_hf cannot be imported."""

import ast
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from stem_hf import StemForCausalLM
from stem_hf.remote_check import load_without_package
from tests.conftest import TINY, tiny_model


def test_save_pretrained_writes_auto_map_and_flat_code(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_stem.StemConfig",
        "AutoModel": "modeling_stem.StemModel",
        "AutoModelForCausalLM": "modeling_stem.StemForCausalLM",
    }
    assert config["architectures"] == ["StemForCausalLM"]
    assert {"configuration_stem.py", "modeling_stem.py"} <= {p.name for p in tmp_path.iterdir()}


def test_copied_code_is_flat_and_imports_only_torch_and_transformers(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    copied = sorted(p.name for p in tmp_path.glob("*.py"))
    assert copied == ["checkpoint_stem.py", "compat_stem.py", "configuration_stem.py", "modeling_stem.py"]
    for name in copied:
        tree = ast.parse((tmp_path / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    assert node.level == 1 and node.module and "." not in node.module, f"{name}: line {node.lineno}"
                    continue
                roots = [node.module.split(".")[0]]
            else:
                continue
            for root in roots:
                assert root in ("torch", "transformers") or root in sys.stdlib_module_names, f"{name}: imports {root}"


@pytest.mark.slow
def test_loads_with_trust_remote_code_without_the_package(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    input_ids = torch.randint(3, TINY["vocab_size"], (2, 6))
    out = load_without_package(tmp_path, input_ids, max_new_tokens=4)
    assert out["module"].startswith("transformers_modules"), out["module"]
    assert torch.equal(out["generated"], out["uncached"])  # the cache changes nothing: greedy on full forwards
    assert out["train_loss_after"] < out["train_loss_before"]  # the copied code trains
    with torch.no_grad():
        assert torch.equal(out["logits"], model(input_ids).logits)
        assert torch.equal(out["hidden"], model.model(input_ids).last_hidden_state)  # through AutoModel


@pytest.mark.slow
def test_a_checkpoint_saved_today_gives_the_tokens_saved_under_transformers_5_23(tmp_path):
    """A fixed reference, not the package's own output: logits and greedy tokens of tests/data/saved-5.23."""
    data = Path(__file__).parent / "data" / "saved-5.23"
    reference = load_file(data / "reference.safetensors")
    StemForCausalLM.from_pretrained(data / "checkpoint").save_pretrained(tmp_path)
    new_tokens = reference["greedy"].shape[1] - reference["prompts"].shape[1]
    out = load_without_package(tmp_path, reference["prompts"], max_new_tokens=new_tokens)
    assert torch.equal(out["logits"], reference["logits"])
    assert torch.equal(out["generated"], reference["greedy"])
    assert torch.equal(out["uncached"], reference["greedy"])


@pytest.mark.slow
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
