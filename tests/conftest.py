import os

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from stem_hf import StemConfig, StemForCausalLM, training

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_config(**overrides) -> StemConfig:
    return StemConfig(**{**TINY, "stem_layers": [1, 3], **overrides})


def tiny_model(**overrides) -> StemForCausalLM:
    return StemForCausalLM(tiny_config(**overrides)).eval()


# Parses each command line given as JSON on stdin as `python SCRIPT ARGS` would (the script's folder first on the
# path), all in one process, so the imports (torch, transformers) are paid once: the script runs until its parser has
# read the whole line, which ends it (`--help` would end it sooner, before an unknown option is reported; arguments
# left unread by `parse_known_args` are refused). Checks a script makes after parsing (one option against another) do
# not run. Prints each one's exit status and the end of what it wrote to stderr, as JSON.
_PARSE_ALL = """
import argparse, contextlib, io, json, os, runpy, sys
class Parsed(BaseException):  # not an Exception: a script's `except Exception` cannot swallow it and go on
    pass
inside = []
def stop_after(parse, known):
    def parsed(self, *args, **kwargs):
        if inside:  # parse_args reading its line through parse_known_args: it checks the rest itself
            return parse(self, *args, **kwargs)
        inside.append(parse)
        try:
            out = parse(self, *args, **kwargs)
        finally:
            inside.pop()
        if known and out[1]:  # what a script reading known arguments would leave unread
            self.error("unrecognized arguments: " + " ".join(out[1]))
        raise Parsed
    return parsed
argparse.ArgumentParser.parse_args = stop_after(argparse.ArgumentParser.parse_args, False)
argparse.ArgumentParser.parse_known_args = stop_after(argparse.ArgumentParser.parse_known_args, True)
results = []
for script, arguments in json.load(sys.stdin):
    sys.argv, sys.path[0] = [script, *arguments], os.path.dirname(os.path.abspath(script))
    err, code = io.StringIO(), "never parsed its arguments"
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            runpy.run_path(script, run_name="__main__")
    except Parsed:
        code = 0
    except SystemExit as exit:
        code = exit.code
    except Exception as error:
        code = f"raised {error!r}"
    results.append([code, err.getvalue()[-2000:]])
print(json.dumps(results))
"""


def parse_benchmark_runs(runs: list[list]) -> list[list]:
    """`[script, arguments]` pairs (script paths from the repository root) parsed by each script's own parser in one
    subprocess (`_PARSE_ALL`), the repository importable: `[exit status, end of stderr]` each."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _PARSE_ALL], input=json.dumps(runs), cwd=root, capture_output=True,
                          text=True, check=True, env={**os.environ, "PYTHONPATH": root})  # fmt: skip
    return json.loads(done.stdout)


def benchmark_script(name: str):
    """`benchmarks/{name}.py` imported as a module (its `main` not run), for tests of its helpers."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def sensitive_model(std: float = 1.0, **overrides) -> StemForCausalLM:
    """A tiny model whose tables matter to its outputs: the paper's xavier init is tiny, so rows are drawn larger."""
    torch.manual_seed(0)
    model = tiny_model(**overrides)
    with torch.no_grad():
        for table in model.model.stem_tables.values():
            table.weight.normal_(0, std)
    return model


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose private (copy-on-write) mappings in this process hold the tensor's first and last bytes; None
    where its bytes are not a private map of one file (a copy in anonymous memory, or a tensor off the CPU)."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    first = tensor.data_ptr()
    last = first + tensor.numel() * tensor.element_size() - 1
    files = {first: set(), last: set()}
    with open(f"/proc/{os.getpid()}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or not fields[1].endswith("p") or not fields[5].startswith("/"):
                continue  # shared, anonymous, or a pseudo-file such as [heap]
            start, end = (int(x, 16) for x in fields[0].split("-"))
            for address, found in files.items():
                if start <= address < end:
                    found.add(os.path.realpath(fields[5].rstrip("\n")))
    both = files[first] & files[last]
    return both.pop() if len(both) == 1 else None


BYTE_VOCAB = 259  # <pad>, <s>, </s> and the 256 bytes


def byte_tokenizer():
    """A real fast tokenizer over bytes (no merges), ids matching TINY's pad/bos/eos: any text tokenizes, no Hub."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(alphabet)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def position_weighted(t: torch.Tensor) -> list[float]:
    """A checksum that a swapped row or a misplaced shard changes, not only a changed value; and its scale."""
    weighted = t.double().flatten() * torch.arange(1, t.numel() + 1)
    return [weighted.sum().item(), weighted.abs().sum().item()]


def _mapped_files(tensor: torch.Tensor) -> list[str]:
    """The files whose mapping in this process holds the tensor's first byte."""
    address, files = tensor.data_ptr(), []
    with open(f"/proc/{os.getpid()}/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end and len(fields) >= 6:
                files.append(fields[5])
    return files


def _dataset(n: int = 16, length: int = 12, seed: int = 0, ragged: bool = False):
    """Token rows where the next token is mostly predictable (a repeating pattern with a random start)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        start = int(torch.randint(3, 40, (1,), generator=g))
        ids = [(start + 5 * k) % 90 + 3 for k in range(length)]
        labels = list(ids)
        if ragged:  # different numbers of label tokens per row: accumulation must weigh tokens, not rows
            labels[: 1 + i % 7] = [-100] * (1 + i % 7)
        rows.append({"input_ids": ids, "labels": labels})
    return Dataset.from_list(rows)


# Dense sources for conversion: tiny models of transformers' own classes, token ids and a word tokenizer over SHAPE's
# vocabulary, and a converted pair.

SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
)
SOURCES = {
    "llama": lambda tied: LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=tied, attention_bias=True)),
    "mistral": lambda tied: MistralForCausalLM(MistralConfig(**SHAPE, tie_word_embeddings=tied, sliding_window=None)),
    "qwen2": lambda tied: Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=tied)),
    "qwen3": lambda tied: Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=8, tie_word_embeddings=tied)),
}


def _dense(kind: str, tied: bool = False):
    torch.manual_seed(0)
    model = SOURCES[kind](tied).eval()
    with torch.no_grad():  # nonzero biases and norms, so that dropping one would show
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return model


def _texts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, SHAPE["vocab_size"], (length,), generator=g).tolist() for _ in range(n)]


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(SHAPE["vocab_size"] - 4)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def _cli_source(tmp_path) -> None:
    """A tiny Llama folder with a word tokenizer in `tmp_path/src`; 400 words each of calibration and held-out text."""
    _dense("llama").save_pretrained(tmp_path / "src")
    _word_tokenizer().save_pretrained(tmp_path / "src")
    for name, seed in (("calib.txt", 1), ("held.txt", 2)):
        ids = torch.randint(0, 60, (400,), generator=torch.Generator().manual_seed(seed))
        (tmp_path / name).write_text(" ".join(f"w{i}" for i in ids.tolist()))


def _opinionated(kind: str, tied: bool = False):
    dense = _dense(kind, tied)
    with torch.no_grad():  # a random model at the default init predicts nearly uniformly: give it opinions
        for name, param in dense.named_parameters():
            if name.endswith(("proj.weight", "embed_tokens.weight", "lm_head.weight")):
                param.normal_(0.0, 0.3)
    return dense


def _converted(layers=(1, 2), init="fitted", tied=False):
    from stem_hf.conversion import convert

    dense = _opinionated("llama", tied)
    stem, _ = convert(
        dense,
        stem_layers=list(layers),
        init=init,
        calibration=_texts(6, 120, seed=1),
        chunk_len=60,
        table_dtype="float32",
    )
    return dense, stem


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def row_workers(monkeypatch):
    """Host rows shared out to two serial row workers (a fresh pool, and a fresh table writer) from two rows a step,
    so that tiny models take that path; torch's thread count is put back after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(training, "_ROW_WORKERS", None)
    monkeypatch.setattr(training, "_TABLE_WRITER", None)  # a writer started now: its thread count is fixed at its start
    monkeypatch.setattr(training, "ROWS_PER_WORKER", 1)
    yield
    for made in (training._ROW_WORKERS and training._ROW_WORKERS[0], training._TABLE_WRITER):
        if made is not None:
            made.shutdown()
    torch.set_num_threads(threads)


def dense_adamw_steps(compiled_dense: bool | None, dtype: torch.dtype, steps: int = 4, device: str = "cpu"):
    """`steps` steps of `RowSparseAdamW` over two matrices and a vector of `dtype` on `device` (decayed and not, a
    scheduler moving the learning rate, an eps that shows where it is added, the second matrix without a gradient at
    step 1, so the group's step counts differ) and of torch's float32 AdamW over float32 copies; returns both
    parameter lists, our optimizer and theirs."""
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(shape).to(device, dtype)) for shape in ((48, 40), (8, 40), (40,))]
    theirs = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]
    settings = {"lr": 1e-2, "eps": 1e-3}
    optimizer = training.RowSparseAdamW(
        [{"params": ours[:2], "weight_decay": 0.1}, {"params": ours[2:], "weight_decay": 0.0}],
        compiled_dense=compiled_dense,
        **settings,
    )
    reference = torch.optim.AdamW(
        [{"params": theirs[:2], "weight_decay": 0.1}, {"params": theirs[2:], "weight_decay": 0.0}], **settings
    )
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1 / (step + 1)) for o in (optimizer, reference)]
    for step in range(steps):
        for params in (ours, theirs):
            for i, param in enumerate(params):
                grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(10 * step + i)).to(device)
                param.grad = None if (step, i) == (1, 1) else grad.to(param.dtype)
        for o, schedule in zip((optimizer, reference), schedules, strict=True):
            o.step()
            schedule.step()
    return ours, theirs, optimizer, reference


class AllocatedShapes:
    """Records the shapes of the dense tensors allocated inside (aten outputs seen by a dispatch mode, views and
    in-place results on `model`'s parameters left out): a `[vocab, d_ff]` gradient or optimizer state shows up."""

    def __init__(self, model):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.shapes, params = set(), {p.untyped_storage().data_ptr() for p in model.parameters()}
        shapes = self.shapes

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for tensor in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided:
                        if tensor.untyped_storage().data_ptr() not in params:
                            shapes.add(tuple(tensor.shape))
                return out

        self.mode = Mode()

    def __enter__(self) -> set[tuple[int, ...]]:
        self.mode.__enter__()
        return self.shapes

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)
