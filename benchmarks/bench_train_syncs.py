"""Host syncs and time of a train step with resident tables and sparse table gradients (`StemTrainer`'s default),
side by side in one run: STEM's gradient over the forward's distinct ids (`StemDistinctRowsGrad`, the default) against
`nn.Embedding`'s sparse gradient, a row per position that the optimizer coalesces (the path before), and a dense
Llama of the same shape.

- `syncs`: host syncs per step (forward with labels, backward, `clip_grad_norm`, `RowSparseAdamW`'s step, as
  `StemTrainer` runs them), counted on this CPU by `stem_hf.host_syncs.train_step_syncs` (all but the backward, which
  makes no sync of its own here) with the tables' update on the accelerator's path (`adamw_rows`, eager), as on a
  GPU: the median over the steps after the moments stop growing, and the operations of the last step.
- `cpu_ms`: the step's time on this CPU (the host's own paths), timed in turn round by round.

    .venv/bin/python benchmarks/bench_train_syncs.py     # JSON in benchmarks/results/bench_train_syncs.json
"""

import argparse
import json
import statistics

import torch
from bench_gpu import paired_s, save, token_ids
from transformers import LlamaConfig, LlamaForCausalLM

from stem_hf import training
from stem_hf.cli_args import positive_int
from stem_hf.configuration_stem import StemConfig
from stem_hf.host_syncs import train_step_syncs
from stem_hf.modeling_stem import StemForCausalLM, StemTableRows
from stem_hf.training import RowSparseAdamW, clip_grad_norm, param_groups, use_sparse_table_grads

# Small layers and a 32000-token vocabulary: the tables' gradients weigh as much as at scale, the rest far less.
SHAPE = dict(vocab_size=32000, hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4)


def build(spec: str | None):
    torch.manual_seed(0)
    if spec is None:
        return LlamaForCausalLM(LlamaConfig(**SHAPE)).train()
    model = StemForCausalLM(StemConfig(**SHAPE, stem_layers=spec, table_dtype="float32")).train()
    use_sparse_table_grads(model)
    return model


DISTINCT_GRAD = StemTableRows.distinct_grad


def per_position(enable: bool) -> None:
    """`nn.Embedding`'s sparse gradient (a row per position) where `enable`, instead of the distinct rows'."""
    StemTableRows.distinct_grad = (lambda self, table: False) if enable else DISTINCT_GRAD


def stepper(model, optimizer, ids):
    """A train step as StemTrainer takes it (clipping included)."""

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        clip_grad_norm(model.parameters(), 1.0)
        optimizer.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=positive_int, default=4)
    parser.add_argument("--seq-len", type=positive_int, default=256)
    parser.add_argument("--steps", type=positive_int, default=8, help="steps counted, after the moments stop growing")
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--out", default="benchmarks/results/bench_train_syncs.json")
    args = parser.parse_args()
    cpu = torch.device("cpu")
    batches = [token_ids("zipf", (args.batch_size, args.seq_len), SHAPE["vocab_size"], cpu, seed=s) for s in range(4)]
    variants = {"dense": (None, False)}
    for spec in ("1/2", "full"):
        variants[f"stem_{spec.replace('/', '_')}_distinct_rows"] = (spec, False)
        variants[f"stem_{spec.replace('/', '_')}_per_position"] = (spec, True)
    report = {"shape": SHAPE, "args": vars(args), "torch": torch.__version__, "threads": torch.get_num_threads()}
    report["syncs"] = {}
    in_host_memory, by_default = training._in_host_memory, training.compiles_rows_by_default
    training._in_host_memory, training.compiles_rows_by_default = (lambda p: False), (lambda d: False)
    try:  # the accelerator's update path, taken on this CPU
        for name, (spec, position) in variants.items():
            per_position(position)
            model = build(spec)
            optimizer = RowSparseAdamW(param_groups(model, 1e-3, row_sparse_tables=spec is not None))
            counts = []
            for i in range(4 * len(batches) + args.steps):  # the moments stop growing within the warm-up
                syncs = train_step_syncs(model, batches[i % len(batches)], optimizer)
                counts.append(syncs.count)
            report["syncs"][name] = {"per_step": statistics.median(counts[-args.steps :]), "last_step": syncs.by_op}
    finally:
        training._in_host_memory, training.compiles_rows_by_default = in_host_memory, by_default
        per_position(False)
    report["cpu_ms"] = {}
    for spec in ("1/2", "full"):
        fns = []
        for position in (False, True):
            model = build(spec)
            optimizer = RowSparseAdamW(param_groups(model, 1e-3, row_sparse_tables=True))
            step = stepper(model, optimizer, batches[0])

            def timed(step=step, position=position):
                per_position(position)
                try:
                    step()
                finally:
                    per_position(False)

            fns.append(timed)
        distinct, position = (statistics.median(t) * 1e3 for t in paired_s(fns, args.repeats, cpu))
        report["cpu_ms"][spec] = {
            "distinct_rows": round(distinct, 2),
            "per_position": round(position, 2),
            "speedup": round(position / distinct, 2),
        }
    save(report, args.out)
    print(json.dumps({k: report[k] for k in ("syncs", "cpu_ms")}, indent=2))


if __name__ == "__main__":
    main()
