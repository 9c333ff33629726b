"""The optimizer step of a model's dense parameters: `RowSparseAdamW`'s foreach pass against its compiled one
(`compiled_dense`, the default on CUDA with Triton), beside torch's AdamW (foreach, and fused where torch has it), side
by side in one run, in float32 and bf16.

The dense parameters of a Llama of `--shape` (`bench_gpu.SHAPES`: embedding, attention, SwiGLU, norms, head), random,
each with a random gradient, one copy per way, timed in turn round by round (`bench_gpu.paired_s`: a drift of the
machine's speed hits every way alike), the compiles in the warm-up. Per dtype: each way's `ms`, `gb_per_s` (the bytes
one pass over the parameter, its gradient and float32 moments reads and writes, over the step's time: what a
memory-bound step can reach; for torch's AdamW on bf16, whose moments are bf16, float32 moments all the same),
`speedup_over_foreach`, and after the timed steps the largest difference of each way's
parameters from the foreach pass's (`max_diff_vs_foreach`; torch's AdamW keeps bf16 moments for bf16 parameters, so
its bf16 figures differ by more than rounding). `RowSparseAdamW` keeps float32 moments and computes in float32 for
every parameter; torch's AdamW in the parameter's dtype.

    .venv/bin/python benchmarks/bench_dense_step.py                  # this CPU: JSON in bench_dense_step.json
    python benchmarks/bench_dense_step.py --device cuda --shape 0.75b --out benchmarks/results/bench_dense_step_gpu.json
"""

import argparse
import json

import torch
from bench_gpu import SHAPES, VOCAB, paired_s, save
from transformers import LlamaConfig, LlamaForCausalLM

from stem_hf.cli_args import positive_int
from stem_hf.training import RowSparseAdamW, param_groups


def dense_parameters(shape: str, device: torch.device, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """The parameters of a random dense Llama of `shape`, in `dtype` on `device`, each with a random gradient."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB[shape], **SHAPES[shape])
    with torch.device("meta"):
        shapes = [p.shape for p in LlamaForCausalLM(config).parameters()]
    params = []
    for shape_ in shapes:
        param = torch.nn.Parameter(torch.randn(shape_, device=device, dtype=dtype) * 0.02)
        param.grad = torch.randn(shape_, device=device, dtype=dtype) * 1e-3
        params.append(param)
    return params


def optimizers(params: list[torch.nn.Parameter]) -> dict:
    """A fresh copy of `params` (their gradients too) per way, and its optimizer (learning rate 1e-4, weight decay 0.1
    on matrices, as `param_groups` puts them)."""

    def copy() -> torch.nn.Module:
        module = torch.nn.Module()
        for i, param in enumerate(params):
            twin = torch.nn.Parameter(param.detach().clone())
            twin.grad = param.grad.clone()
            module.register_parameter(f"p{i}", twin)
        return module

    ways = {
        "foreach": lambda m: RowSparseAdamW(param_groups(m, 1e-4, 0.1), compiled_dense=False),
        "compiled": lambda m: RowSparseAdamW(param_groups(m, 1e-4, 0.1), compiled_dense=True),
        "torch_adamw": lambda m: torch.optim.AdamW(param_groups_plain(m), lr=1e-4),
    }
    if hasattr(torch, "_fused_adamw_"):
        ways["torch_adamw_fused"] = lambda m: torch.optim.AdamW(param_groups_plain(m), lr=1e-4, fused=True)
    out = {}
    for name, make in ways.items():
        module = copy()
        out[name] = (module, make(module))
    return out


def param_groups_plain(module: torch.nn.Module) -> list[dict]:
    """`param_groups`' decay and no-decay groups without its extra keys, for torch's AdamW."""
    return [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in param_groups(module, 1e-4, 0.1)]


def case(args, device: torch.device, dtype: torch.dtype) -> dict:
    params = dense_parameters(args.shape, device, dtype)
    count = sum(p.numel() for p in params)
    ways = optimizers(params)
    del params
    steps = [optimizer.step for _, optimizer in ways.values()]
    for _ in range(args.warmup - 1):  # paired_s adds one warm-up step per way: compiles, moments allocated
        for step in steps:
            step()
    times = paired_s(steps, args.repeats, device)
    # One pass: read the parameter and gradient, read and write both float32 moments, write the parameter.
    moved = count * (3 * torch.finfo(dtype).bits // 8 + 4 * 4)
    reference = [p.detach().float() for p in ways["foreach"][0].parameters()]
    out = {"parameters": count, "one_pass_bytes": moved}
    for (name, (module, _)), runs in zip(ways.items(), times, strict=True):
        ms = sorted(runs)[len(runs) // 2] * 1e3
        pairs = zip(module.parameters(), reference, strict=True)
        diff = max((p.detach().float() - r).abs().max().item() for p, r in pairs)
        out[name] = {"ms": round(ms, 3), "gb_per_s": round(moved / ms / 1e6, 1), "max_diff_vs_foreach": diff}
    for name in ways:
        out[name]["speedup_over_foreach"] = round(out["foreach"]["ms"] / out[name]["ms"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default="medium", choices=sorted(SHAPES))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--warmup", type=positive_int, default=3, help="steps of each way before timing (compiles)")
    parser.add_argument("--out", default="benchmarks/results/bench_dense_step.json")
    args = parser.parse_args()
    dtypes = [getattr(torch, name, None) for name in args.dtypes.split(",")]
    if not all(isinstance(dtype, torch.dtype) and dtype.is_floating_point for dtype in dtypes):
        parser.error(f"--dtypes: floating-point torch dtypes, comma-separated, not {args.dtypes!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    device = torch.device(args.device)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "args": vars(args)}
    result["torch"], result["threads"] = torch.__version__, torch.get_num_threads()
    for dtype in dtypes:
        result[str(dtype).removeprefix("torch.")] = case(args, device, dtype)
        save(result, args.out)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
