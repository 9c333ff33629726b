"""Fine-tuning a STEM checkpoint with a plain `Trainer` and its defaults: the share of the touched table values that an
update actually moves, with the tables trained as stored (bf16, the old default) and upcast to float32 by `train()`
(the default now), side by side on the same checkpoint, batches and learning rates; and what of it a save keeps: the
default save (float32 once `train()` upcast the tables) reloaded, and a bf16 save (computed by rounding).

The checkpoint is SmolLM2-135M converted to STEM-1/3 with `--init projected` (rows from the dense weights, no
calibration: seconds), its tables stored in bf16 as `stem-hf convert` writes them. "Touched" values are the table rows
of the tokens that receive a gradient (every position but the last of each sequence).

    .venv/bin/python benchmarks/bench_finetune_precision.py   # JSON in benchmarks/results/bench_finetune_precision.json
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Trainer, TrainingArguments

from stem_hf import StemForCausalLM
from stem_hf.assets import corpora, smollm2_gguf
from stem_hf.conversion import convert
from stem_hf.conversion.text import chunk_texts


def batches(tokenizer, bos: int, steps: int, batch: int, length: int) -> list[dict]:
    chunks = chunk_texts(corpora()["calibration"], tokenizer, bos, length, None)
    chunks = [c for c in chunks if len(c) == length][: steps * batch]
    return [{"input_ids": c, "labels": c} for c in chunks]


def finetune(checkpoint: Path, data: list[dict], lr: float, steps: int, batch: int, upcast: bool) -> dict:
    model = StemForCausalLM.from_pretrained(checkpoint)
    tables = model.model.stem_tables
    tables.upcast_for_training = upcast
    touched = torch.unique(torch.stack([d["input_ids"][:-1] for d in data]))
    before = {k: t.weight[touched].float().clone() for k, t in tables.items()}
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=batch,
        learning_rate=lr,
        max_steps=steps,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    args = args.set_save(strategy="no").set_logging(strategy="steps", steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    trained_dtype = str(next(iter(tables.values())).weight.dtype).removeprefix("torch.")
    with tempfile.TemporaryDirectory() as saved_dir:
        model.save_pretrained(saved_dir)  # the default save: the tables as held, float32 once train() upcast them
        saved_model = StemForCausalLM.from_pretrained(saved_dir)
        saved_dtype, saved = saved_model.config.table_dtype, saved_model.model.stem_tables
        moved, kept_by_save, kept_by_bf16 = [], [], []
        for key, table in tables.items():
            after = table.weight[touched].float()
            moved.append((after != before[key]).float().mean().item())
            kept_by_save.append((saved[key].weight[touched].float() != before[key]).float().mean().item())
            # What a save in bf16 (save_pretrained(..., table_dtype="bfloat16")) would keep of the update.
            kept_by_bf16.append((after.bfloat16().float() != before[key]).float().mean().item())
        del saved, saved_model
    return {
        "lr": lr,
        "tables_trained_in": trained_dtype,
        "saved_table_dtype": saved_dtype,
        "touched_values_changed": sum(moved) / len(moved),
        "touched_values_changed_after_default_save": sum(kept_by_save) / len(kept_by_save),
        "touched_values_changed_if_saved_in_bf16": sum(kept_by_bf16) / len(kept_by_bf16),
        "losses": [round(e["loss"], 4) for e in trainer.state.log_history if "loss" in e],
        "train_seconds": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-5, 1e-3])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results/bench_finetune_precision.json")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "stem-1-3-projected"
        model, _ = convert(smollm2_gguf(), checkpoint, stem_layers="1/3", init="projected", table_dtype="bfloat16")

        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        data = batches(tokenizer, model.config.bos_token_id, args.steps, args.batch, args.length)
        del model
        runs = []
        for lr in args.lrs:
            for upcast in (False, True):
                run = finetune(checkpoint, data, lr, args.steps, args.batch, upcast)
                run["arm"] = "float32 (train() upcasts: default)" if upcast else "as stored, bf16 (before)"
                print(json.dumps(run))
                runs.append(run)
    result = {
        "checkpoint": "SmolLM2-135M -> STEM-1/3, init projected, tables stored in bfloat16",
        "trainer": "transformers.Trainer, default arguments but learning_rate, max_steps and batch size",
        "steps": args.steps,
        "batch": args.batch,
        "length": args.length,
        "runs": runs,
        "wall_time_s": round(time.perf_counter() - start, 1),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
