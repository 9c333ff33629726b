"""PEFT's trainable tokens on STEM tables (`lora_config(token_ids=...)`, PEFT's `trainable_token_indices`): the
model's own path, where each STEM layer looks its table up as it looks up any table and puts the trained rows in at
their ids (`modeling_stem.trained_tokens`), against PEFT's own forward, which merges the trained rows into a copy of
the whole table at every forward (and whose backward builds a `[vocab, d_ff]` gradient to pick them out), side by side
in one run.

A random STEM model of `--shape` (SmolLM2-135M's by default: hidden 576, d_ff 1536, 30 layers, vocab 49152), tables
in `--table-dtype`, LoRA r=8 on attention and the dense FFN projections and `--tokens` trained ids per table (the
`--tokens` most frequent under the batch's Zipf distribution, so that the batch holds most of them:
`trained_ids_in_batch`). Two modes: `train` (forward with labels, backward, torch's AdamW step over the adapter at
learning rate 0: the same work, and every step sees the same weights) and `inference` (a forward under
`inference_mode`), each timed both ways in turn round by round (`bench_gpu.paired_s`). Per mode: `rows_ms` and
`peft_ms` (medians), `speedup` (PEFT's time over the rows path's), and from one more step each way, untimed:
`*_allocated_mib` (the bytes of every tensor the step's operations made, summed: a dispatch mode sees each),
`*_largest` (the largest tensor's shape), `*_table_copies` (tensors of a table's shape) and `logits_max_diff` (the
rows path's logits against PEFT's).
PEFT's own path is what a hook on the token wrapper gives (`trained_tokens` leaves a hooked module to its forward).

    .venv/bin/python benchmarks/bench_peft_tokens.py            # this CPU: bench_peft_tokens.json
    python benchmarks/bench_peft_tokens.py --shape tiny --repeats 2 --out /tmp/peft_tokens.json
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from bench_gpu import SHAPES, VOCAB, paired_s, save, token_ids
from peft import get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from stem_hf import StemConfig, StemForCausalLM
from stem_hf.cli_args import positive_int
from stem_hf.training import lora_config

SHAPES = {
    **SHAPES,
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9),
}
VOCAB = {**VOCAB, "smollm2": 49152}


class Allocations(TorchDispatchMode):
    """The tensors the operations inside make (outputs whose memory is none of their inputs': views and in-place
    results are not counted): their bytes summed, the largest's shape, how many have `shape`."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.shape, self.bytes, self.largest, self.copies = shape, 0, (), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        held = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
                continue
            if tensor.untyped_storage().data_ptr() in held:
                continue
            self.bytes += tensor.untyped_storage().nbytes()
            if tensor.numel() > torch.Size(self.largest).numel():
                self.largest = tuple(tensor.shape)
            self.copies += tuple(tensor.shape) == self.shape
        return out


def build(args: argparse.Namespace) -> torch.nn.Module:
    """A random STEM model of `args.shape` with LoRA and trainable tokens, in float32 but for the tables."""
    torch.manual_seed(0)
    config = StemConfig(
        **SHAPES[args.shape],
        vocab_size=VOCAB[args.shape],
        num_key_value_heads=SHAPES[args.shape]["num_attention_heads"],
        max_position_embeddings=4096,
        stem_layers=args.spec,
        table_dtype=args.table_dtype,
    )
    base = StemForCausalLM(config)
    ids = list(range(args.tokens))  # the most frequent of `token_ids`'s Zipf ids (id i is rank i + 1)
    return get_peft_model(base, lora_config(base, r=8, lora_alpha=16, token_ids=ids))


@contextmanager
def peft_forward(model: torch.nn.Module, enable: bool) -> Iterator[None]:
    """PEFT's own forward of the trainable tokens while `enable`: a hook on each wrapper hands it the lookup."""
    wrappers = [m for m in model.modules() if type(m).__name__ == "TrainableTokensWrapper"]
    handles = [w.register_forward_pre_hook(lambda *a: None) for w in wrappers] if enable else []
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def train_step(model: torch.nn.Module, ids: torch.Tensor, optimizer: torch.optim.Optimizer, peft: bool) -> torch.Tensor:
    with peft_forward(model, peft):
        optimizer.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer.step()
    return out.logits.detach()


def inference(model: torch.nn.Module, ids: torch.Tensor, peft: bool) -> torch.Tensor:
    with peft_forward(model, peft), torch.inference_mode():
        return model(input_ids=ids).logits


def measured(run: Callable[[], torch.Tensor], table_shape: tuple[int, int]) -> tuple[torch.Tensor, dict]:
    with Allocations(table_shape) as seen:
        logits = run()
    figures = {"allocated_mib": round(seen.bytes / 2**20, 1), "largest": list(seen.largest)}
    return logits, {**figures, "table_copies": seen.copies}


def compare(
    run: Callable[[bool], torch.Tensor], repeats: int, device: torch.device, table_shape: tuple[int, int]
) -> dict:
    """`run(peft)` the rows path's way and PEFT's, timed in turn round by round, then measured once each."""
    times = paired_s([lambda: run(False), lambda: run(True)], repeats, device)
    rows_ms, peft_ms = (round(statistics.median(t) * 1e3, 3) for t in times)
    rows_logits, rows = measured(lambda: run(False), table_shape)
    peft_logits, peft = measured(lambda: run(True), table_shape)
    return {
        "rows_ms": rows_ms,
        "peft_ms": peft_ms,
        "speedup": round(peft_ms / rows_ms, 3),
        **{f"rows_{k}": v for k, v in rows.items()},
        **{f"peft_{k}": v for k, v in peft.items()},
        "logits_max_diff": (rows_logits.float() - peft_logits.float()).abs().max().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--spec", default="1/2", help="stem_layers: which layers are STEM layers")
    parser.add_argument("--table-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--tokens", type=positive_int, default=64, help="trained ids per table")
    parser.add_argument("--batch-size", type=positive_int, default=2)
    parser.add_argument("--seq-len", type=positive_int, default=256)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--out", default="benchmarks/results/bench_peft_tokens.json")
    args = parser.parse_args()
    if args.tokens > VOCAB[args.shape]:
        parser.error(f"--tokens {args.tokens}: the vocabulary of {args.shape} has {VOCAB[args.shape]} ids")

    started = time.perf_counter()
    model = build(args)
    device = torch.device("cpu")
    ids = token_ids("zipf", (args.batch_size, args.seq_len), VOCAB[args.shape], device)
    table_shape = (VOCAB[args.shape], SHAPES[args.shape]["intermediate_size"])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)
    report = {
        "args": vars(args),
        "torch": torch.__version__,
        "stem_layers": model.config.stem_layers,
        "trained_ids_in_batch": int(torch.isin(torch.arange(args.tokens), ids).sum()),
        "table_shape": list(table_shape),
    }
    modes = {
        "train": lambda peft: train_step(model.train(), ids, optimizer, peft),
        "inference": lambda peft: inference(model.eval(), ids, peft),
    }
    for mode, run in modes.items():
        report[mode] = compare(run, args.repeats, device, table_shape)
        print(json.dumps({mode: report[mode]}))
    report["seconds"] = round(time.perf_counter() - started, 1)
    save(report, args.out)


if __name__ == "__main__":
    main()
