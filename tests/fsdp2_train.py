"""Three steps of StemTrainer's optimizer on a tiny STEM model with torch's FSDP2 (`fully_shard`, what `accelerate
launch --use_fsdp --fsdp_version 2` applies) on CPU with gloo, or in one process; run by tests/test_distributed.py.
Usage: torchrun --nproc_per_node 2 tests/fsdp2_train.py OUT   |   python tests/fsdp2_train.py OUT"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import TrainingArguments

from stem_hf.training import RowSparseAdamW, StemTrainer
from tests.conftest import _dataset, position_weighted, tiny_model

out = sys.argv[1]
distributed = "RANK" in os.environ
rank, world = 0, 1
if distributed:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = tiny_model(table_dtype="float32")
shard_rows = None
if distributed:
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)  # the root holds the embedding, the tables and the head
    table = model.model.stem_tables["1"].weight
    assert isinstance(table, DTensor), type(table)
    shard_rows = table.to_local().shape[0]
# StemTrainer's optimizer: torch's AdamW over the STEM groups once the tables are sharded DTensors; in one process,
# RowSparseAdamW without row sparsity, the same math (tested against torch's AdamW in test_training.py).
args = TrainingArguments(output_dir=out, learning_rate=1e-2, weight_decay=0.1, use_cpu=True, report_to=[])
optimizer = StemTrainer(model=model, args=args, row_sparse_tables=False).create_optimizer()
assert isinstance(optimizer, torch.optim.AdamW if distributed else RowSparseAdamW), type(optimizer)
rows = _dataset(12)[:]
ids, labels = torch.tensor(rows["input_ids"]), torch.tensor(rows["labels"])
losses = []
for step in range(3):
    global_batch = slice(4 * step, 4 * step + 4)  # same rows as one process; each rank takes its half
    mine = slice(global_batch.start + rank * 4 // world, global_batch.start + (rank + 1) * 4 // world)
    loss = model(input_ids=ids[mine], labels=labels[mine]).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    mean = loss.detach().clone()
    if distributed:
        dist.all_reduce(mean)
        mean /= world
    losses.append(mean.item())
state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
if rank == 0:
    result = {
        "world_size": world,
        "shard_rows": shard_rows,
        "losses": losses,
        "sums": {k: position_weighted(v) for k, v in state.items()},
    }
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f)
if distributed:
    dist.destroy_process_group()
