"""Which transformers releases run a STEM checkpoint correctly, through the package and through its copied code.

For each interpreter given (venvs that differ in their transformers; by default .venv-oldest, .venv-5.23, .venv and
.venv-newest where they exist, as `make test-oldest`, `make test-5.23` and `make check-newest` build them), loads
tests/data/saved-5.23 (saved by stem-hf 774b1ef under transformers 5.23) four ways and checks three things against the
logits and greedy tokens saved there: load (logits equal), generate (greedy with the default cache equals the saved
tokens), train step (one AdamW step lowers the loss on its batch). The ways: the package's classes; the copied code as
saved (written for `past_key_values`); that code after `stem-hf refresh-code`; the checkpoint saved again by the
package. Copied code runs in a subprocess that cannot import stem_hf.

    python benchmarks/compat_matrix.py                      # -> benchmarks/results/compat_matrix.json
    python benchmarks/compat_matrix.py --python .venv-5.23/bin/python --python .venv/bin/python
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "saved-5.23"
RESULTS = ROOT / "benchmarks" / "results" / "compat_matrix.json"
DEFAULT_PYTHONS = (".venv-oldest/bin/python", ".venv-5.23/bin/python", ".venv/bin/python", ".venv-newest/bin/python")


def _checks(logits, generated, loss_before: float, loss_after: float, reference: dict) -> dict:
    import torch

    return {
        "load": bool(torch.equal(logits, reference["logits"])),
        "generate": bool(torch.equal(generated, reference["greedy"])),
        "train_step": bool(loss_after < loss_before),
    }


def _package(reference: dict) -> dict:
    import torch

    from stem_hf import StemForCausalLM
    from stem_hf.remote_check import train_step

    model = StemForCausalLM.from_pretrained(DATA / "checkpoint").eval()
    prompts = reference["prompts"]
    new_tokens = reference["greedy"].shape[1] - prompts.shape[1]
    with torch.no_grad():
        logits = model(prompts).logits
        generated = model.generate(prompts, max_new_tokens=new_tokens, do_sample=False)
    losses = train_step(model, prompts)  # the same step the copied code takes in `_remote`
    return _checks(logits, generated, losses["train_loss_before"], losses["train_loss_after"], reference)


def _remote(folder: Path, reference: dict) -> dict:
    from stem_hf.remote_check import load_without_package

    new_tokens = reference["greedy"].shape[1] - reference["prompts"].shape[1]
    out = load_without_package(folder, reference["prompts"], max_new_tokens=new_tokens)
    return _checks(out["logits"], out["generated"], out["train_loss_before"], out["train_loss_after"], reference)


def worker() -> dict:
    """The four ways under this interpreter's transformers."""
    import torch
    import transformers
    from safetensors.torch import load_file

    from stem_hf import StemForCausalLM
    from stem_hf.refresh import refresh_code

    reference = load_file(DATA / "reference.safetensors")
    with tempfile.TemporaryDirectory() as tmp:
        refreshed = Path(tmp) / "refreshed"
        shutil.copytree(DATA / "checkpoint", refreshed)
        refresh_code(refreshed)
        resaved = Path(tmp) / "resaved"
        StemForCausalLM.from_pretrained(DATA / "checkpoint").save_pretrained(resaved)
        ways = {
            "package": _package(reference),
            "copied code as saved under 5.23": _remote(DATA / "checkpoint", reference),
            "copied code after refresh-code": _remote(refreshed, reference),
            "copied code of a checkpoint saved today": _remote(resaved, reference),
        }
    return {"transformers": transformers.__version__, "torch": torch.__version__, "ways": ways}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", help="an interpreter to run the checks under (repeatable)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker()))
        return
    pythons = args.python or [p for p in DEFAULT_PYTHONS if (ROOT / p).exists()]
    runs = []
    for python in pythons:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
        run = subprocess.run(
            [python, __file__, "--worker"], cwd=ROOT, env=env, capture_output=True, text=True, check=False
        )
        if run.returncode:
            sys.exit(f"{python} failed:\n{run.stderr[-3000:]}")
        runs.append({"python": python, **json.loads(run.stdout.strip().splitlines()[-1])})
        print(json.dumps(runs[-1]))
    result = {"fixture": str(DATA.relative_to(ROOT)), "runs": runs}
    partial = f"{args.out}.partial"
    with open(partial, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(partial, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
