"""Training the lab's models: dense, STEM-1/2 and STEM-full at matched active parameters per token, from scratch with
`StemTrainer`, on the same blocks in the same order, fp32 tables; and the training regimes that decide where an
entity's identity is kept.

Regimes (STEM only; a dense model keeps the identity of a token nowhere but in its embedding):
- `plain`: ordinary training, nothing hidden (the paper trains this way).
- `entity-dropout-P`: each entity token's input id is replaced by `<mask>` with probability P, while its table
  lookups (`stem_input_ids`) keep the true id; the model learns to find the entity in the rows.
- `shared-embedding`: every entity token's input-embedding row is one shared row without gradient, so the identity
  can only live in the tables (the control under which a row swap must move the answers).

Entity tokens are the words of people's names and the countries' names.
"""

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.utils.data import Dataset

from ..accounting import summarize
from ..configuration_stem import StemConfig
from ..modeling_stem import StemForCausalLM
from ..pretrain import PretrainSettings, configs, training_arguments
from ..training import StemTrainer
from .corpus import LabWorld, documents

REGIME = re.compile(r"^(plain|shared-embedding|entity-dropout-(0(\.\d+)?|1(\.0+)?))$")
REGIMES = ("plain", "entity-dropout-0.5", "entity-dropout-0.9", "shared-embedding")
DEFAULT_REGIME = "entity-dropout-0.5"  # the best for row edits in benchmarks/results/knowledge_lab.json


@dataclass
class LabSettings(PretrainSettings):
    """`stem-hf pretrain`'s settings with the lab's shape (the dense model's; STEM models widen their FFN to match its
    active parameters) and schedule, and the world: `people`, and the share of general text and its words."""

    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 4
    context: int = 64
    batch_size: int = 32
    steps: int = 1500
    people: int = 300
    general_share: float = 0.2
    general_words: int = 1000


QUICK = LabSettings(people=24, steps=600, general_share=0.1, general_words=300)


def check_regime(regime: str, stem: bool) -> float:
    """The entity dropout probability of `regime` (0 for `plain` and `shared-embedding`, which shares the rows in the
    weights instead); raises on an unknown name, or on a regime other than `plain` for a dense model."""
    if not REGIME.match(regime):
        raise ValueError(f"lab: unknown regime {regime!r}: one of plain, shared-embedding, entity-dropout-P (0<=P<=1)")
    if regime != "plain" and not stem:
        raise ValueError(f"lab: regime {regime!r} hides entity tokens' embeddings; a dense model has only those")
    return float(regime.rsplit("-", 1)[1]) if regime.startswith("entity-dropout-") else 0.0


class Blocks(Dataset):
    """Fixed-length training blocks cut from the tokenized documents (each `<s> ... </s>`)."""

    def __init__(self, world: LabWorld, tokenizer, general_texts: list[str], settings: LabSettings):
        needed = settings.steps * settings.batch_size * settings.context
        docs = documents(world, general_texts, needed, settings.general_share, settings.seed)
        ids = [i for doc in tokenizer(docs)["input_ids"] for i in (*doc, tokenizer.eos_token_id)]
        repeats = math.ceil(needed / len(ids))  # word counts undercount tokens, so this is 1 but for tiny corpora
        self.data = torch.tensor((ids * repeats)[:needed]).view(-1, settings.context)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i]}


class EntityDropoutCollator:
    """Batches blocks; with `p > 0`, each entity token's input id becomes `mask_id` with probability `p` (seeded), and
    `stem_input_ids` carries the true ids to the tables. Labels are always the true ids."""

    def __init__(self, entity_ids: torch.Tensor, mask_id: int, p: float, seed: int):
        self.entity_ids, self.mask_id, self.p = entity_ids, mask_id, p
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, examples: list[dict]) -> dict:
        ids = torch.stack([e["input_ids"] for e in examples])
        batch = {"input_ids": ids, "labels": ids.clone()}
        if self.p > 0:
            hide = torch.isin(ids, self.entity_ids) & (torch.rand(ids.shape, generator=self.generator) < self.p)
            batch["stem_input_ids"] = ids
            batch["input_ids"] = ids.masked_fill(hide, self.mask_id)
        return batch


def share_entity_embedding(model: StemForCausalLM, entity_ids: torch.Tensor, shared_id: int) -> None:
    """Sets every entity token's input-embedding row to the row of `shared_id` and zeroes their gradient, so they stay
    one row, identical to each other (decoupled weight decay scales identical rows identically); the `shared_id` row
    itself trains on. With tied embeddings the output head's entity rows are that one row too."""
    weight = model.get_input_embeddings().weight
    with torch.no_grad():
        weight[entity_ids] = weight[shared_id].clone()
    weight.register_hook(lambda grad: grad.index_fill(0, entity_ids.to(grad.device), 0.0))


def lab_configs(settings: LabSettings, vocab_size: int) -> dict[str, StemConfig]:
    """`dense`, `STEM-1/2` and `STEM-full` configs at matched active parameters per token."""
    dense, half = configs(replace(settings, stem_layers="1/2"), vocab_size)
    _, full = configs(replace(settings, stem_layers="full"), vocab_size)
    return {"dense": dense, "STEM-1/2": half, "STEM-full": full}


def entity_ids(world: LabWorld, tokenizer) -> torch.Tensor:
    return torch.tensor(sorted(tokenizer.convert_tokens_to_ids(sorted(world.entity_words()))))


def train_lab_model(
    config: StemConfig,
    regime: str,
    data: Blocks,
    world: LabWorld,
    tokenizer,
    settings: LabSettings,
    out: str | Path,
) -> tuple[StemForCausalLM, dict]:
    """Trains one model from scratch on `data` (in the same order for every model: the seeds are fixed) and returns it
    with its sizes, training time and loss curve."""
    p = check_regime(regime, bool(config.stem_layers))
    entities = entity_ids(world, tokenizer)
    torch.manual_seed(settings.seed)
    model = StemForCausalLM(config)
    if regime == "shared-embedding":
        share_entity_embedding(model, entities, tokenizer.mask_token_id)
    collator = EntityDropoutCollator(entities, tokenizer.mask_token_id, p, settings.seed)
    args = training_arguments(Path(out), settings, eval_strategy="no", logging_steps=max(1, settings.steps // 50))
    trainer = StemTrainer(
        model=model, args=args, train_dataset=data, data_collator=collator, table_lr=settings.table_lr
    )
    seconds = trainer.train().metrics["train_runtime"]
    tokens_per_step = settings.batch_size * settings.context
    s = summarize(config, context_length=settings.context)
    return model.eval(), {
        "regime": regime,
        "stem_layers": list(config.stem_layers),
        "intermediate_size": config.intermediate_size,
        "total_params": s["total_params"],
        "table_params": s["table_params"],
        "active_params_per_token": s["active_params_per_token"],
        "train_seconds": seconds,
        "train_tokens": settings.steps * tokens_per_step,
        "train_loss": [(h["step"] * tokens_per_step, h["loss"]) for h in trainer.state.log_history if "loss" in h],
    }


__all__ = [
    "DEFAULT_REGIME",
    "QUICK",
    "REGIMES",
    "Blocks",
    "EntityDropoutCollator",
    "LabSettings",
    "check_regime",
    "entity_ids",
    "lab_configs",
    "share_entity_embedding",
    "train_lab_model",
]
