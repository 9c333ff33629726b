"""What `benchmarks/paper_claims.py` measures on a model while and after it trains: per-step training loss, the loss
of a fixed monitor batch after every step and its spikes, validation loss (overall and by token position),
knowledge-probe recall along the way, training FLOPs, and the MoE's expert load. Every model, the MoEs included, trains
through `StemTrainer` with `stem-hf pretrain`'s arguments (`training_arguments`) and the settings' recipe.
"""

import time
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import median

import torch
from torch import nn
from transformers import MixtralForCausalLM, PrinterCallback, TrainerCallback

from ..accounting import flops_per_token
from ..configuration_stem import StemConfig
from ..modeling_stem import StemForCausalLM, StemMLP, StemTableMLP
from ..pretrain import PretrainSettings, training_arguments
from ..training import StemTrainer
from .measure import Probe, accuracy
from .variants import active_parameters, is_hash_moe, load_summary

# The spike rule, on the loss of a fixed monitor batch after every step (a training batch's loss moves with what the
# batch holds): above (1 + SPIKE_MARGIN) times the median of the SPIKE_WINDOW steps before it.
SPIKE_WINDOW = 25
SPIKE_MARGIN = 0.1
MONITOR_BLOCKS = 4  # from each validation set
POSITION_BUCKETS = (1, 8, 32, 64, 128, 256, 512)  # loss by position: [1, 8), [8, 32), ... (position 0 has no loss)


def loss_spikes(losses: list[float], window: int = SPIKE_WINDOW, margin: float = SPIKE_MARGIN) -> list[int]:
    """Indices of the steps whose loss exceeds `(1 + margin)` times the median of the `window` losses before them, or
    is not finite. A loss that falls, however fast, never counts; one that climbs back past the running median does."""
    spikes = []
    for t, loss in enumerate(losses):
        if not torch.isfinite(torch.tensor(loss)):
            spikes.append(t)
        elif t >= window and loss > (1 + margin) * median(losses[t - window : t]):
            spikes.append(t)
    return spikes


class TokenBlocks(torch.utils.data.Dataset):
    """Training blocks from a `[n, context]` tensor of token ids."""

    def __init__(self, data: torch.Tensor):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i]}


def token_blocks(tokenizer, texts: list[str], context: int, limit: int | None = None) -> torch.Tensor:
    """`[n, context]` token ids of `texts` joined with EOS (at most `limit` blocks; the tail that fills no block is
    dropped)."""
    ids = [i for doc in tokenizer(texts, add_special_tokens=False)["input_ids"] for i in (*doc, tokenizer.eos_token_id)]
    n = len(ids) // context if limit is None else min(limit, len(ids) // context)
    if n == 0:
        raise ValueError(f"claims: {len(ids)} tokens do not fill one block of {context}")
    return torch.tensor(ids[: n * context]).view(n, context)


def causal_batch(examples: list[dict]) -> dict:
    ids = torch.stack([e["input_ids"] for e in examples])
    return {"input_ids": ids, "labels": ids.clone()}


@torch.no_grad()
def token_losses(model: nn.Module, blocks: torch.Tensor, batch_size: int = 16) -> torch.Tensor:
    """`[n_blocks, context - 1]` next-token losses (nats) over `blocks` of token ids: the language-model loss alone
    (an MoE's load-balancing loss is not in it)."""
    was_training = model.training
    model.eval()
    out = []
    for start in range(0, len(blocks), batch_size):
        ids = blocks[start : start + batch_size].to(model.device)
        logits = model(input_ids=ids).logits.float()
        out.append(nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").cpu())
    model.train(was_training)
    return torch.cat(out)


def loss_by_position(losses: torch.Tensor, buckets: tuple[int, ...] = POSITION_BUCKETS) -> dict[str, float]:
    """Mean loss of the tokens at positions `[lo, hi)` for consecutive bucket edges (a position is the predicted
    token's index in its block), as `{"lo-hi": loss}`; buckets past the blocks' length are left out."""
    n = losses.shape[1] + 1
    edges = [b for b in buckets if b < n] + [n]
    return {f"{lo}-{hi}": losses[:, lo - 1 : hi - 1].mean().item() for lo, hi in zip(edges, edges[1:], strict=False)}


@torch.no_grad()
def expert_load(model: MixtralForCausalLM, blocks: torch.Tensor, batch_size: int = 16) -> dict:
    """Share of the routed token slots each expert receives, per layer, over `blocks`; `max_over_mean` is the busiest
    expert's share times the number of experts (1.0 is a perfect balance), and `idle_experts` those under a tenth of
    the mean."""
    config = model.config
    counts = torch.zeros(config.num_hidden_layers, config.num_local_experts)
    was_training = model.training
    model.eval()
    for start in range(0, len(blocks), batch_size):
        out = model(input_ids=blocks[start : start + batch_size].to(model.device), output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):
            chosen = logits.topk(config.num_experts_per_tok, dim=-1).indices.flatten().cpu()
            counts[layer] += torch.bincount(chosen, minlength=config.num_local_experts).float()
    model.train(was_training)
    return load_summary(counts)


def training_flops(model: nn.Module, context: int) -> int | None:
    """Training FLOPs per token (3x the forward's: backward twice the forward) at the mean context of a causal block
    of `context` tokens, for a STEM or dense `StemForCausalLM` and for the MoEs, whose `top_k` experts do the dense
    FFN's multiply-adds (the hash MoE has no router; Mixtral's adds `hidden x experts` per layer); None for the
    ablations, whose FFNs cost what `flops_per_token` does not count."""
    if isinstance(model, MixtralForCausalLM):
        c = model.config
        shape = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers)
        shape |= dict(num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads)
        dense = StemConfig(**shape, intermediate_size=c.intermediate_size * c.num_experts_per_tok, stem_layers=[])
        router = 2 * c.hidden_size * c.num_local_experts * c.num_hidden_layers
        return 3 * (flops_per_token(dense, (context + 1) // 2) + router)
    if is_hash_moe(model):
        return 3 * flops_per_token(replace(model.config, stem_layers=[]), (context + 1) // 2)
    plain = (StemMLP, StemTableMLP)
    if not isinstance(model, StemForCausalLM) or any(type(layer.mlp) not in plain for layer in model.model.layers):
        return None
    return 3 * flops_per_token(model.config, (context + 1) // 2)


@dataclass
class Probes:
    """What to measure along training: before it and every `every` steps, recall on `questions` and the loss on each
    named set of `valid` blocks; after every step the loss on the first `MONITOR_BLOCKS` of each set (the monitor
    batch, the spike rule's curve)."""

    questions: list[Probe]
    valid: dict[str, torch.Tensor]
    every: int

    @property
    def monitor(self) -> torch.Tensor:
        return torch.cat([blocks[:MONITOR_BLOCKS] for blocks in self.valid.values()])


class ProbeCallback(TrainerCallback):
    """Records `{"step", "recall", "loss": {set: loss}}` before training, every `probes.every` steps and at the end,
    the monitor batch's loss after every step, and the seconds all this takes (not training's)."""

    def __init__(self, model: nn.Module, probes: Probes):
        self.model, self.probes, self.points, self.monitor, self.seconds = model, probes, [], [], 0.0
        self._monitor = probes.monitor

    def _probe(self, step: int) -> None:
        hits = accuracy(self.model, self.probes.questions).mean().item() if self.probes.questions else None
        loss = {name: token_losses(self.model, blocks).mean().item() for name, blocks in self.probes.valid.items()}
        self.points.append({"step": step, "recall": hits, "loss": loss})

    def on_train_begin(self, args, state, control, **kwargs):
        start = time.perf_counter()
        self._probe(0)
        self.seconds += time.perf_counter() - start

    def on_step_end(self, args, state, control, **kwargs):
        start = time.perf_counter()
        self.monitor.append(token_losses(self.model, self._monitor).mean().item())
        if state.global_step % self.probes.every == 0 or state.global_step == state.max_steps:
            self._probe(state.global_step)
        self.seconds += time.perf_counter() - start


def train_model(
    model: nn.Module, data: torch.utils.data.Dataset, settings: PretrainSettings, out: Path, probes: Probes
) -> dict:
    """Trains `model` on `data` (blocks of `settings.context` tokens, in the order the seed fixes) through
    `StemTrainer` with `settings.recipe` (`stem-hf`: tables undecayed at `settings.table_lr`, for a model without
    tables AdamW over the same groups; `paper`: the reference AdamW over every parameter), logging every step; returns
    the per-step losses (an MoE's include its load-balancing loss) and gradient norms, the monitor curve, the probe
    points, the sizes and the training FLOPs."""
    args = training_arguments(out, settings, eval_strategy="no", logging_steps=1, disable_tqdm=True)
    callback = ProbeCallback(model, probes)
    trainer = StemTrainer(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=causal_batch,
        callbacks=[callback],
        table_lr=settings.table_lr,
        recipe=settings.recipe,
    )
    trainer.remove_callback(PrinterCallback)  # a log line per step; the caller's progress bar says where it is
    seconds = trainer.train().metrics["train_runtime"]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    tokens_per_step = settings.batch_size * settings.context
    return {
        "lr": settings.lr,
        "seed": settings.seed,
        "total_params": model.num_parameters(),
        "active_params_per_token": active_parameters(model),
        "intermediate_size": model.config.intermediate_size,
        "train_flops_per_token": training_flops(model, settings.context),
        "tokens_per_step": tokens_per_step,
        "train_seconds": seconds - callback.seconds,  # the probes and the monitor left out
        "probe_seconds": callback.seconds,
        "train_loss": [h["loss"] for h in logs],
        "grad_norm": [h.get("grad_norm") for h in logs],
        "monitor_loss": callback.monitor,
        "probes": [{**p, "tokens": p["step"] * tokens_per_step} for p in callback.points],
    }


__all__ = [
    "MONITOR_BLOCKS",
    "POSITION_BUCKETS",
    "SPIKE_MARGIN",
    "SPIKE_WINDOW",
    "ProbeCallback",
    "Probes",
    "TokenBlocks",
    "causal_batch",
    "token_blocks",
    "expert_load",
    "loss_by_position",
    "loss_spikes",
    "token_losses",
    "train_model",
    "training_flops",
]
