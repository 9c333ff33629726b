"""`stem-hf pretrain`: a dense model and a STEM model of matching active parameters, trained from scratch on the same
tokens of a local corpus with `Trainer`, side by side.

Both are `StemForCausalLM` (the dense one has no STEM layers and is exactly a Llama model), so the comparison changes
one thing: in the STEM layers the up-projection is a table, and the intermediate size grows until the active parameters
per token match the dense model's. A BPE tokenizer is trained on the training split first (`tokenizers`).
"""

import copy
import json
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerFast, TrainingArguments

from .accounting import summarize
from .configuration_stem import StemConfig
from .extras import require
from .modeling_stem import StemForCausalLM
from .training import PAPER_ARGUMENTS, StemTrainer, check_recipe


@dataclass
class PretrainSettings:
    vocab_size: int = 8192
    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    context: int = 128
    stem_layers: str = "1/2"
    batch_size: int = 16
    steps: int = 400
    lr: float = 3e-3
    table_lr: float | None = None  # the reference code trains tables at the backbone's learning rate
    recipe: str = "stem-hf"  # StemTrainer's optimizer recipe: "stem-hf", or "paper" (the reference code's)
    warmup: float = 0.05
    eval_every: int = 50
    valid_fraction: float = 0.05
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        check_recipe(self.recipe)
        if self.recipe == "paper" and self.table_lr is not None:
            raise ValueError("recipe 'paper' trains the tables at the backbone's learning rate: leave table_lr unset")
        clash = sorted(k for k in self.extra if self.recipe == "paper" and k in PAPER_ARGUMENTS)
        if clash:
            raise ValueError(
                f"recipe 'paper' sets {', '.join(clash)} itself (PAPER_ARGUMENTS): leave them out of extra"
            )


def split_corpus(texts: list[str], valid_fraction: float, seed: int, piece: int = 4000) -> tuple[list[str], list[str]]:
    """Pieces of about `piece` characters, shuffled (seeded); the last `valid_fraction` of them are held out."""
    pieces = [t[i : i + piece] for t in texts for i in range(0, len(t), piece)]
    random.Random(seed).shuffle(pieces)
    n_valid = max(1, int(len(pieces) * valid_fraction))
    if len(pieces) < 2:
        raise ValueError("corpus: too little text to hold out validation pieces (need at least 8,000 characters)")
    return pieces[n_valid:], pieces[:n_valid]


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def blocks(texts: list[str], tokenizer, context: int) -> Dataset:
    """Fixed-length training blocks of `context` tokens cut from the concatenated texts (EOS between texts)."""
    ids = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    n = len(ids) // context
    if n == 0:
        raise ValueError(f"corpus: {len(ids)} tokens do not fill one block of context {context}")
    data = torch.tensor(ids[: n * context]).view(n, context)
    return Dataset.from_dict({"input_ids": data.tolist(), "labels": data.tolist()})


def configs(settings: PretrainSettings, vocab_size: int) -> tuple[StemConfig, StemConfig]:
    """The dense config and the STEM config whose intermediate size (a multiple of 8) brings its active parameters
    per token closest to the dense model's."""
    shape = dict(
        vocab_size=vocab_size,
        hidden_size=settings.hidden_size,
        num_hidden_layers=settings.num_hidden_layers,
        num_attention_heads=settings.num_attention_heads,
        num_key_value_heads=settings.num_key_value_heads,
        max_position_embeddings=settings.context,
        tie_word_embeddings=True,
        table_dtype="float32",
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    dense = StemConfig(**shape, intermediate_size=settings.intermediate_size, stem_layers=[])
    target = summarize(dense)["active_params_per_token"]

    def gap(size: int) -> int:
        stem = StemConfig(**shape, intermediate_size=size, stem_layers=settings.stem_layers)
        return abs(summarize(stem)["active_params_per_token"] - target)

    best = min(range(settings.intermediate_size, 4 * settings.intermediate_size + 1, 8), key=gap)
    return dense, StemConfig(**shape, intermediate_size=best, stem_layers=settings.stem_layers)


def training_arguments(out: Path, settings: PretrainSettings, **overrides) -> TrainingArguments:
    """From-scratch training: linear warmup, then cosine decay, the same seed for weights and data order, no
    checkpoints. With `settings.recipe="stem-hf"`, AdamW with weight decay 0.1 on the dense matrices (StemTrainer's
    groups), Trainer's betas (0.9, 0.999) and cosine to 0; with `"paper"`, the reference code's `PAPER_ARGUMENTS`
    (betas (0.9, 0.95), cosine to a tenth of the rate; decay on every parameter through the recipe's one group).
    `overrides` win over these and `settings.extra`."""
    args = dict(
        output_dir=str(out),
        per_device_train_batch_size=settings.batch_size,
        per_device_eval_batch_size=settings.batch_size,
        learning_rate=settings.lr,
        weight_decay=0.1,
        warmup_steps=int(settings.warmup * settings.steps),
        lr_scheduler_type="cosine",
        max_steps=settings.steps,
        eval_strategy="steps",
        eval_steps=settings.eval_every,
        logging_steps=max(1, settings.eval_every // 5),
        save_strategy="no",
        report_to=[],
        seed=settings.seed,
        data_seed=settings.seed,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
    )
    if settings.recipe == "paper":
        args.update(copy.deepcopy(PAPER_ARGUMENTS))
    return TrainingArguments(**{**args, **settings.extra, **overrides})


def train_one(config: StemConfig, train: Dataset, valid: Dataset, settings: PretrainSettings, out: Path) -> dict:
    torch.manual_seed(settings.seed)
    model = StemForCausalLM(config)
    args = training_arguments(out, settings)
    trainer = StemTrainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=valid,
        table_lr=settings.table_lr,
        recipe=settings.recipe,
    )
    seconds = trainer.train().metrics["train_runtime"]  # the whole train loop, its periodic evaluations included
    if settings.steps % settings.eval_every:  # the last periodic evaluation is not at the end
        trainer.evaluate()
    history = trainer.state.log_history
    s = summarize(config, context_length=settings.context)
    tokens_per_step = settings.batch_size * settings.context
    valid = [(h["step"] * tokens_per_step, h["eval_loss"]) for h in history if "eval_loss" in h]
    return {
        "intermediate_size": config.intermediate_size,
        "stem_layers": list(config.stem_layers),
        "total_params": s["total_params"],
        "active_params_per_token": s["active_params_per_token"],
        "flops_per_token": s["flops_per_token"],
        "final_valid_loss": valid[-1][1],
        "train_seconds": seconds,
        "tokens_per_second": settings.steps * tokens_per_step / seconds,
        "train_loss": [(h["step"] * tokens_per_step, h["loss"]) for h in history if "loss" in h],
        "valid_loss": valid,
    }


def plot(results: dict, path: Path) -> None:
    matplotlib = require("matplotlib")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for (name, run), color in zip(results.items(), ("tab:blue", "tab:orange"), strict=False):
        label = f"{name} ({run['active_params_per_token'] / 1e6:.2f}M active, {run['total_params'] / 1e6:.1f}M total)"
        tokens, loss = zip(*run["train_loss"], strict=True)
        ax.plot(tokens, loss, color=color, alpha=0.35, linewidth=1)
        tokens, loss = zip(*run["valid_loss"], strict=True)
        ax.plot(tokens, loss, color=color, marker="o", markersize=3, label=f"{label}: validation")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("loss (nats/token); faint: training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def pretrain(texts: list[str], out: str | os.PathLike, settings: PretrainSettings | None = None) -> dict:
    """Trains the dense and the STEM model on the same blocks in the same order; writes `results.json` and
    `curves.png` to `out` and returns the results."""
    settings = settings or PretrainSettings()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train_texts, valid_texts = split_corpus(texts, settings.valid_fraction, settings.seed)
    tokenizer = train_tokenizer(train_texts, settings.vocab_size)
    tokenizer.save_pretrained(out / "tokenizer")
    train, valid = blocks(train_texts, tokenizer, settings.context), blocks(valid_texts, tokenizer, settings.context)
    dense, stem = configs(settings, len(tokenizer))
    runs = {}
    for name, config in (("dense", dense), (f"STEM-{settings.stem_layers}", stem)):
        runs[name] = train_one(config, train, valid, settings, out / name)
    names = list(runs)
    result = {
        "settings": asdict(settings),
        "train_tokens_available": len(train) * settings.context,
        "valid_tokens": len(valid) * settings.context,
        "tokens_trained": settings.steps * settings.batch_size * settings.context,
        "runs": runs,
        "stem_over_dense": {
            "final_valid_loss": runs[names[1]]["final_valid_loss"] / runs[names[0]]["final_valid_loss"],
            "active_params": runs[names[1]]["active_params_per_token"] / runs[names[0]]["active_params_per_token"],
            "flops_per_token": runs[names[1]]["flops_per_token"] / runs[names[0]]["flops_per_token"],
            "tokens_per_second": runs[names[1]]["tokens_per_second"] / runs[names[0]]["tokens_per_second"],
        },
    }
    plot(runs, out / "curves.png")
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, out / "results.json")
    return result


__all__ = ["PretrainSettings", "configs", "pretrain", "split_corpus", "train_tokenizer", "training_arguments"]
