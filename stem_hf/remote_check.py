"""Loads a saved checkpoint the way a user without stem_hf does: in a fresh interpreter where `import stem_hf` fails,
through `AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)`, so only the code copied next to the weights
can run. Used by `stem-hf demo` and the tests.

Run as a file (`python path/to/remote_check.py CHECKPOINT INPUTS OUT`), never with `-m`: that would import the package.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def load_without_package(
    checkpoint: str | os.PathLike, input_ids: torch.Tensor, max_new_tokens: int = 4, hub_env: dict | None = None
) -> dict:
    """Returns `{"logits", "generated", "uncached", "hidden", "train_loss_before", "train_loss_after", "module"}`
    computed by the checkpoint's copied code in a subprocess: `generated` by `generate` with its default cache,
    `uncached` by greedy steps of full forwards (the reference a cache must not change), and the loss on the inputs
    before and after one AdamW step (lr 1e-3) of the model in training mode.

    `HF_MODULES_CACHE` points at a temporary folder, so the code comes from the checkpoint, not from an earlier load.
    With `hub_env` (say, `HF_ENDPOINT` of a test Hub), `checkpoint` may be a Hub id: it is downloaded into an empty
    cache. Without it the subprocess is offline.
    """
    if os.path.isdir(checkpoint):
        checkpoint = os.path.abspath(checkpoint)  # the subprocess runs elsewhere; a relative path would read as an id
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        torch.save({"input_ids": input_ids, "max_new_tokens": max_new_tokens}, tmp / "inputs.pt")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(HF_MODULES_CACHE=str(tmp / "modules"))
        env.update({**hub_env, "HF_HOME": str(tmp / "hf")} if hub_env else {"HF_HUB_OFFLINE": "1"})
        result = subprocess.run(
            [sys.executable, __file__, str(checkpoint), str(tmp / "inputs.pt"), str(tmp / "out.pt")],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise RuntimeError(f"loading {checkpoint} without stem_hf failed:\n{result.stderr[-4000:]}")
        return torch.load(tmp / "out.pt")


def _main(checkpoint: str, inputs: str, out: str) -> None:
    import importlib.abc

    class BlockStemHf(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "stem_hf" or name.startswith("stem_hf."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked: this load must use the copied code)")

    sys.meta_path.insert(0, BlockStemHf())
    sys.path = [p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent]
    try:
        import stem_hf  # noqa: F401

        sys.exit("stem_hf is importable: this load would not exercise the copied code")
    except ModuleNotFoundError:
        pass

    from transformers import AutoModel, AutoModelForCausalLM

    args = torch.load(inputs)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(args["input_ids"]).logits
        generated = model.generate(args["input_ids"], max_new_tokens=args["max_new_tokens"], do_sample=False)
        uncached = greedy_without_cache(model, args["input_ids"], args["max_new_tokens"])
        hidden = AutoModel.from_pretrained(checkpoint, trust_remote_code=True)(args["input_ids"]).last_hidden_state
    outputs = {"logits": logits, "generated": generated, "uncached": uncached, "hidden": hidden}
    torch.save({**outputs, **train_step(model, args["input_ids"]), "module": type(model).__module__}, out)


@torch.no_grad()
def greedy_without_cache(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """`input_ids` and `new_tokens` greedy tokens, each from a full forward without a cache: the reference a cache must
    not change."""
    for _ in range(new_tokens):
        step = model(input_ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        input_ids = torch.cat([input_ids, step], dim=1)
    return input_ids


def train_step(model: torch.nn.Module, input_ids: torch.Tensor) -> dict:
    """One AdamW step of the copied code with `input_ids` as labels: the loss before and after it, on the same batch."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = model(input_ids, labels=input_ids).loss
    model.eval()
    return {"train_loss_before": loss.item(), "train_loss_after": after.item()}


if __name__ == "__main__":
    _main(*sys.argv[1:4])
