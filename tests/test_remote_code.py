"""A saved STEM checkpoint carries its own code: it loads with trust_remote_code where stem_hf cannot be imported."""

import json
import os
import subprocess
import sys
import textwrap

import torch
from transformers import AutoModelForCausalLM

import stem_hf
from stem_hf import StemForCausalLM
from tests.conftest import TINY, tiny_model

# Runs in a fresh interpreter: blocks `stem_hf` (the editable install would otherwise find it), loads the checkpoint
# through the Auto class, and writes its logits.
LOAD_WITHOUT_PACKAGE = textwrap.dedent(
    """
    import importlib.abc, importlib.util, sys

    class BlockStemHf(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "stem_hf" or name.startswith("stem_hf."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")

    sys.meta_path.insert(0, BlockStemHf())
    try:
        import stem_hf  # noqa: F401
        sys.exit("stem_hf is importable: the test would not exercise the copied code")
    except ModuleNotFoundError:
        pass

    import torch
    from transformers import AutoModelForCausalLM

    checkpoint, inputs, out = sys.argv[1:4]
    model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    assert type(model).__name__ == "StemForCausalLM"
    input_ids = torch.load(inputs)
    with torch.no_grad():
        logits = model(input_ids).logits
        generated = model.generate(input_ids, max_new_tokens=4, do_sample=False)
    torch.save({"logits": logits, "generated": generated}, out)
    """
)


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
    checkpoint = tmp_path / "checkpoint"
    model.save_pretrained(checkpoint)
    input_ids = torch.randint(3, TINY["vocab_size"], (2, 6))
    torch.save(input_ids, tmp_path / "inputs.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    script = tmp_path / "load.py"
    script.write_text(LOAD_WITHOUT_PACKAGE)
    result = subprocess.run(
        [sys.executable, str(script), str(checkpoint), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "modules" / "transformers_modules").is_dir()
    out = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        assert torch.equal(out["logits"], model(input_ids).logits)
        assert torch.equal(out["generated"], model.generate(input_ids, max_new_tokens=4, do_sample=False))


def test_loads_through_auto_class_with_package_imported(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # registered at import: no trust_remote_code
    assert type(reloaded) is StemForCausalLM
    input_ids = torch.randint(0, TINY["vocab_size"], (1, 5))
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, reloaded(input_ids).logits)
