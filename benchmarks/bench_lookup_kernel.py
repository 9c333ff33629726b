"""The fused table lookup's kernels alone: `SiLU(gate) * table[ids]` (forward) and its gradients (`gated_lookup_grads`)
as inductor compiles them, against the unfused operations (embedding, SiLU, product; eager autograd's backward), at one
STEM layer of the 0.75B shape (8 x 1024 tokens, d_ff 5632, vocab 32000, uniform ids).

Compiled three ways, each its own function (dynamo keeps compiles per function): `dynamic` (`dynamic=True`: every size
symbolic, d_ff too), `token_axis` (as the model compiles it now: `dynamic=False`, the first axis of every argument
symbolic by `rows_dynamic`, d_ff static; the H200 run of `bench_lookup_kernel_h200.json` marked the token axis only,
the vocab static), `static` (`dynamic=False`: one compile per token count). Beside them, where Triton is installed,
`triton`: a hand-written kernel tiled over tokens and d_ff (the rows' offsets a multiple of the static d_ff), as the
bound a compile could reach. Each time is the median over rounds of the mean of
`--inner` calls, CUDA events around them; `GBps` is the bytes the operation must move (gate, rows read once, output)
over that time. `backward_unfused` is eager autograd of the unfused operations, which also sums the rows' gradients
into the table's (a pass the compiled gradients leave to embedding's backward), so only the compiled and hand-written
gradients compare with each other. `table_grad_*`: the backward with the table's gradient summed into the batch's
distinct rows (what training with sparse table gradients needs), four ways, with `*_repeatable` (two runs, the same
bits) and the error against a float64 sum (`table_grads`). `--code-out DIR` writes each forward variant's generated
kernel source there.

    python benchmarks/bench_lookup_kernel.py        # CUDA; bench_lookup_kernel.json (the H200's: *_h200.json)
    python benchmarks/bench_lookup_kernel.py --device cpu --tokens 512 --d-ff 256 --vocab 1000 --out /tmp/k.json
"""

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
from bench_gpu import save, sync
from torch._inductor.utils import run_and_get_code

from stem_hf.cli_args import positive_int, positive_ints
from stem_hf.modeling_stem import gated_lookup, gated_lookup_grads, rows_dynamic


def lookup_dynamic(gate, table, index):
    return gated_lookup(gate, table, index)


def lookup_token_axis(gate, table, index):
    return gated_lookup(gate, table, index)


def lookup_static(gate, table, index):
    return gated_lookup(gate, table, index)


def grads_dynamic(grad, gate, table, index):
    return gated_lookup_grads(grad, gate, table, index)


def grads_token_axis(grad, gate, table, index):
    return gated_lookup_grads(grad, gate, table, index)


def grads_static(grad, gate, table, index):
    return gated_lookup_grads(grad, gate, table, index)


MODES = {"dynamic": True, "token_axis": False, "static": False}  # mode: torch.compile's `dynamic`
FORWARD = {"dynamic": lookup_dynamic, "token_axis": lookup_token_axis, "static": lookup_static}
BACKWARD = {"dynamic": grads_dynamic, "token_axis": grads_token_axis, "static": grads_static}


def compiled(fn: Callable, mode: str) -> Callable:
    run = torch.compile(fn, dynamic=MODES[mode])
    if mode != "token_axis":
        return run

    def marked(*args: torch.Tensor):
        # Marked as the model's fused lookup marks them, on aliases: a mark stays on the tensor it is put on, and the
        # static mode's compile of these very tensors would take their first axis as symbolic too.
        args = tuple(arg.detach() for arg in args)
        rows_dynamic(*args)
        return run(*args)

    return marked


try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the `triton` variant is left out
    triton = None

if triton is not None:

    @triton.jit
    def _lookup_kernel(gate, table, index, out, tokens, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        mask = (t < tokens)[:, None] & (d < D)[None, :]
        rows = tl.load(index + t, mask=t < tokens, other=0)
        x = tl.load(gate + t[:, None] * D + d[None, :], mask=mask).to(tl.float32)
        r = tl.load(table + rows[:, None] * D + d[None, :], mask=mask).to(tl.float32)
        tl.store(out + t[:, None] * D + d[None, :], (x * tl.sigmoid(x) * r).to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _grads_kernel(grad, gate, table, index, grad_gate, grad_rows, tokens, D: tl.constexpr, BT: tl.constexpr,
                      BD: tl.constexpr):  # fmt: skip
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        mask = (t < tokens)[:, None] & (d < D)[None, :]
        rows = tl.load(index + t, mask=t < tokens, other=0)
        at = t[:, None] * D + d[None, :]
        g = tl.load(grad + at, mask=mask).to(tl.float32)
        x = tl.load(gate + at, mask=mask).to(tl.float32)
        r = tl.load(table + rows[:, None] * D + d[None, :], mask=mask).to(gate.dtype.element_ty).to(tl.float32)
        s = tl.sigmoid(x)
        tl.store(grad_gate + at, (g * r * s * (1 + x * (1 - s))).to(grad_gate.dtype.element_ty), mask=mask)
        tl.store(grad_rows + at, (g * x * s).to(grad_rows.dtype.element_ty), mask=mask)


BT, BD = 16, 256


def triton_forward(gate, table, index):
    out = torch.empty_like(gate)
    tokens, d = gate.shape
    _lookup_kernel[(triton.cdiv(tokens, BT), triton.cdiv(d, BD))](gate, table, index, out, tokens, d, BT, BD)
    return out


def triton_backward(grad, gate, table, index):
    grad_gate, grad_rows = torch.empty_like(gate), torch.empty(gate.shape, dtype=table.dtype, device=gate.device)
    tokens, d = gate.shape
    _grads_kernel[(triton.cdiv(tokens, BT), triton.cdiv(d, BD))](grad, gate, table, index, grad_gate, grad_rows,
                                                                 tokens, d, BT, BD)  # fmt: skip
    return grad_gate, grad_rows


def fused_table_grad(grad, gate, table, index, unique, inverse):
    """Both gradients in one compiled function, the rows' summed into the distinct rows' by atomic adds
    (`index_put_(accumulate=True)`): the `[tokens, d_ff]` row gradients are never written."""
    grad_gate, grad_rows = gated_lookup_grads(grad, gate, table, index)
    rows = torch.zeros(unique.shape[0], gate.shape[1], dtype=table.dtype, device=gate.device)
    return grad_gate, rows.index_put_((inverse,), grad_rows, accumulate=True)


def table_grads(args, device, grad, gate, table, index, record) -> dict:
    """The lookup's backward with the table's gradient summed into the batch's distinct rows, four ways: the compiled
    gradients, then embedding's own backward (`distinct_rows_grad`: sorted, deterministic), `index_add_` (atomic adds),
    or `segment_reduce` over the positions sorted once per forward (deterministic); or one compiled function with
    atomic adds. Each result against a float64 sum; whether two runs give the same bits."""
    unique, inverse, counts = torch.unique(index, return_inverse=True, return_counts=True)
    order = torch.sort(inverse, stable=True).indices
    grads = compiled(BACKWARD["token_axis"], "token_axis")
    fused = compiled(fused_table_grad, "token_axis")
    n, width = len(unique), gate.shape[1]

    def embedding_backward():
        grad_gate, grad_rows = grads(grad, gate, table, index)
        return grad_gate, torch.ops.aten.embedding_dense_backward(grad_rows, inverse, n, -1, False)

    def index_add():
        grad_gate, grad_rows = grads(grad, gate, table, index)
        return grad_gate, torch.zeros(n, width, dtype=table.dtype, device=device).index_add_(0, inverse, grad_rows)

    def segments():
        grad_gate, grad_rows = grads(grad, gate, table, index)
        # unsafe: no check of `lengths` (a host sync); they come from `torch.unique`, each at least 1
        return grad_gate, torch.segment_reduce(grad_rows[order], "sum", lengths=counts, unsafe=True)

    x, g = gate.double(), grad.double()
    expected = torch.zeros(n, width, dtype=torch.float64, device=device)
    expected.index_add_(0, inverse, g * x * torch.sigmoid(x))
    moved = grad.numel() * (3 * grad.element_size() + table.element_size()) + n * width * table.element_size()
    out = {"distinct_rows": n, "sort_once_ms": round(timed_ms(lambda: torch.sort(inverse, stable=True), device,
                                                              args.rounds, args.inner), 4)}  # fmt: skip
    ways = {"embedding_backward": embedding_backward, "index_add": index_add, "segment_reduce": segments,
            "fused_atomic": lambda: fused(grad, gate, table, index, unique, inverse)}  # fmt: skip
    # Whether inductor's code sums the rows by atomic adds (else aten's sorted `index_put_`: the label would mislead).
    _, code = run_and_get_code(fused, grad, gate, table, index, unique, inverse)
    out["fused_atomic_adds"] = "atomic_add" in "\n".join(code)
    for name, way in ways.items():
        first, second = way()[1], way()[1]
        out[f"table_grad_{name}_max_diff"] = (first.double() - expected).abs().max().item()
        out[f"table_grad_{name}_repeatable"] = bool(torch.equal(first, second))
        record(f"table_grad_{name}", timed_ms(way, device, args.rounds, args.inner), moved)
    return out


def unfused_forward(gate, table, index):
    return torch.nn.functional.silu(gate) * torch.nn.functional.embedding(index, table).to(gate.dtype)


def timed_ms(fn: Callable[[], object], device: torch.device, rounds: int, inner: int) -> float:
    """Median over `rounds` of the mean milliseconds of `inner` calls (after two warm-up calls)."""
    fn(), fn()
    times = []
    for _ in range(rounds):
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / inner)
        else:
            begin = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - begin) * 1000 / inner)
    return statistics.median(times)


def case(args, device: torch.device, table_dtype: torch.dtype, tokens: int) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    gate = torch.randn(tokens, args.d_ff, device=device, generator=g, dtype=torch.bfloat16)
    table = torch.randn(args.vocab, args.d_ff, device=device, generator=g).to(table_dtype)
    index = torch.randint(0, args.vocab, (tokens,), device=device, generator=g)
    grad = torch.randn_like(gate)
    act, row = gate.element_size(), table.element_size()
    forward_bytes = tokens * args.d_ff * (2 * act + row)  # gate and rows read, output written
    backward_bytes = tokens * args.d_ff * (3 * act + 2 * row)  # grad, gate, rows read; both gradients written
    out = {"tokens": tokens, "table_dtype": str(table_dtype).removeprefix("torch.")}

    def record(name: str, ms: float, nbytes: int) -> None:
        out[name] = {"ms": round(ms, 4), "GBps": round(nbytes / ms / 1e6, 1)}

    reference = unfused_forward(gate, table, index)
    record("forward_unfused", timed_ms(lambda: unfused_forward(gate, table, index), device, args.rounds, args.inner),
           forward_bytes)  # fmt: skip
    leaf_gate, leaf_table = gate.clone().requires_grad_(), table.clone().requires_grad_()
    product = unfused_forward(leaf_gate, leaf_table, index)

    def eager_backward():
        return torch.autograd.grad(product, (leaf_gate, leaf_table), grad, retain_graph=True)

    record("backward_unfused", timed_ms(eager_backward, device, args.rounds, args.inner), backward_bytes)
    for mode in MODES:
        forward, backward = compiled(FORWARD[mode], mode), compiled(BACKWARD[mode], mode)
        _, code = run_and_get_code(forward, gate, table, index)
        if args.code_out:
            os.makedirs(args.code_out, exist_ok=True)
            with open(os.path.join(args.code_out, f"forward_{mode}_{out['table_dtype']}_{tokens}.py"), "w") as f:
                f.write("\n\n".join(code))
        out[f"forward_{mode}_max_diff"] = (forward(gate, table, index).float() - reference.float()).abs().max().item()
        record(f"forward_{mode}", timed_ms(lambda f=forward: f(gate, table, index), device, args.rounds, args.inner),
               forward_bytes)  # fmt: skip
        record(f"backward_{mode}", timed_ms(lambda b=backward: b(grad, gate, table, index), device, args.rounds,
               args.inner), backward_bytes)  # fmt: skip
    out.update(table_grads(args, device, grad, gate, table, index, record))
    if triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        diff = (triton_forward(gate, table, index).float() - reference.float()).abs().max().item()
        out["forward_triton_max_diff"] = diff
        got, expected = triton_backward(grad, gate, table, index), gated_lookup_grads(grad, gate, table, index)
        pairs = zip(got, expected, strict=True)
        out["backward_triton_max_diff"] = max((a.float() - b.float()).abs().max().item() for a, b in pairs)
        record("forward_triton", timed_ms(lambda: triton_forward(gate, table, index), device, args.rounds, args.inner),
               forward_bytes)  # fmt: skip
        record("backward_triton", timed_ms(lambda: triton_backward(grad, gate, table, index), device, args.rounds,
               args.inner), backward_bytes)  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=positive_ints, default="8192,16384", help="comma-separated token counts")
    parser.add_argument("--d-ff", type=positive_int, default=5632)
    parser.add_argument("--vocab", type=positive_int, default=32000)
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--inner", type=positive_int, default=20)
    parser.add_argument("--code-out", default="")
    parser.add_argument("--out", default="benchmarks/results/bench_lookup_kernel.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "args": vars(args), "cases": []}  # fmt: skip
    for table_dtype in (torch.bfloat16, torch.float32):
        for n in args.tokens:
            report["cases"].append(case(args, device, table_dtype, n))
            print(json.dumps(report["cases"][-1]), flush=True)
            save(report, args.out)


if __name__ == "__main__":
    main()
