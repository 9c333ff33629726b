"""Three Trainer steps on a tiny STEM model, alone or under `accelerate launch` (DDP or FSDP); run by
tests/test_distributed.py. Usage: python tests/dist_train.py OUT PER_DEVICE_BATCH [plain|row_sparse]."""

import json
import sys

import torch
from transformers import TrainingArguments

from stem_hf.training import StemTrainer
from tests.conftest import _dataset, position_weighted, tiny_model

out, per_device, optimizer = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = tiny_model(table_dtype="float32")
args = TrainingArguments(
    output_dir=out,
    per_device_train_batch_size=per_device,
    max_steps=3,
    learning_rate=1e-2,
    logging_steps=1,
    report_to=[],
    save_strategy="no",
    use_cpu=not torch.cuda.is_available(),
    train_sampling_strategy="sequential",  # one global batch is the same rows whatever the number of processes
    seed=0,
    disable_tqdm=True,
)
data = _dataset(12, ragged=True)
# Under FSDP, StemTrainer's optimizer is torch's AdamW over the same groups (tables are sharded DTensors).
trainer = StemTrainer(model=model, args=args, train_dataset=data, row_sparse_tables=optimizer == "row_sparse")
trainer.train()
state = trainer.accelerator.get_state_dict(trainer.model)  # a collective under FSDP: every rank calls it
if trainer.is_world_process_zero():
    result = {
        "world_size": trainer.args.world_size,
        "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
        "sums": {k: position_weighted(t) for k, t in state.items()},
        "distributed_type": str(trainer.accelerator.distributed_type),
    }
    with open(f"{out}/result.json", "w") as f:
        json.dump(result, f)
