"""The paper's remaining claims at lab scale (`benchmarks/paper_claims.py` runs them; docs in benchmarks/README.md),
under one of two protocols:

- `matched`: STEM widens its FFN until its active parameters per token match dense's (equal FLOPs), and every model
  trains with the `stem-hf` recipe; the ablations and long context run under it only;
- `paper`: every model has dense's shape (STEM then has fewer FLOPs, as in the paper), trains with the reference
  code's recipe (`StemTrainer(recipe="paper")`), and the hash-routed fine-grained MoE joins Mixtral's top-2.

- stability: dense, STEM-1/2, STEM-full and the MoEs, on the same tokens, at each learning rate of `lrs` (every seed
  at the first, the lab's; the first `other_lr_seeds` at the others);
- training ROI: knowledge-probe recall and validation loss against training FLOPs, STEM against dense, every seed;
- ablations: the table at the gate, added to the up projection, at the down projection, against STEM (the up);
- long context: dense and STEM-full trained on real text at a long context; loss by position, activated table
  parameters against context length.

Each trained run is kept as JSON in `out/runs/` and reused by a later call with the same settings, so an interrupted
benchmark resumes where it stopped.
"""

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import mean, stdev

import torch
import transformers
from tqdm import tqdm
from transformers import MixtralForCausalLM

from ..analysis import activated_parameters
from ..configuration_stem import StemConfig
from ..modeling_stem import StemForCausalLM
from ..pretrain import configs as pretrain_configs
from ..pretrain import train_tokenizer
from .claims import (
    Probes,
    TokenBlocks,
    expert_load,
    loss_by_position,
    loss_spikes,
    token_blocks,
    token_losses,
    train_model,
)
from .corpus import build_tokenizer, make_world
from .measure import probes
from .run import write_json
from .train import Blocks, LabSettings, lab_configs
from .variants import build_hash_moe, build_variant, hash_expert_load, is_hash_moe, moe_config, variant_config

HEADLINE = ("dense", "STEM-1/2", "STEM-full", "MoE")
PAPER_HEADLINE = (*HEADLINE, "hash MoE")
PROTOCOLS = ("matched", "paper")
ABLATED = {"table at the gate": "gate", "table added to the up": "added", "table at the down": "down"}


@dataclass
class ClaimsSettings:
    """The lab's model shape, world and schedule (`lab`), and what this benchmark adds to them."""

    lab: LabSettings = field(default_factory=LabSettings)
    seeds: tuple[int, ...] = (0, 1, 2)
    lrs: tuple[float, ...] = (3e-3, 3e-2, 1e-1)  # the lab's rate first: every seed there
    other_lr_seeds: int = 2  # the first seeds at the other rates
    ablation_seeds: int = 1
    probe_every: int = 100
    valid_blocks: int = 128
    long_context: int = 512
    long_batch_size: int = 4  # the lab's tokens per step at the long context
    long_vocab_size: int = 4096
    long_valid_blocks: int = 32
    long_text_pieces: int | None = None  # registry text pieces per split for the long-context runs (None: all)
    protocol: str = "matched"

    def __post_init__(self):
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol: {self.protocol!r} is not one of {', '.join(PROTOCOLS)}")
        recipe = {"matched": "stem-hf", "paper": "paper"}[self.protocol]
        if self.lab.recipe != recipe:
            raise ValueError(f"protocol {self.protocol!r} trains with recipe {recipe!r}, not {self.lab.recipe!r}")

    @property
    def headline(self) -> tuple[str, ...]:
        return PAPER_HEADLINE if self.protocol == "paper" else HEADLINE


def paper_protocol(settings: ClaimsSettings, other_lr_seeds: int = 1) -> ClaimsSettings:
    """`settings` under the paper's protocol: dense's shape for every model and the reference recipe; one seed at the
    other learning rates by default (the lab's rate keeps every seed)."""
    lab = replace(settings.lab, recipe="paper")
    return replace(settings, lab=lab, protocol="paper", other_lr_seeds=min(other_lr_seeds, len(settings.seeds)))


QUICK_CLAIMS = ClaimsSettings(
    lab=LabSettings(people=16, steps=12, batch_size=4, general_words=200, general_share=0.1, warmup=0.1),
    seeds=(0, 1),
    lrs=(3e-3, 3e-2),
    other_lr_seeds=1,
    probe_every=4,
    valid_blocks=8,
    long_context=64,
    long_batch_size=4,
    long_vocab_size=512,
    long_valid_blocks=4,
    long_text_pieces=100,
)


# Part of every run's cache key: bump it when a change to the training or the measures changes a run's result.
RUNS_VERSION = 3


class RunCache:
    """Trained runs' results as `folder/<key>-<stamp>.json`; the stamp hashes the key, the settings the run depends on,
    `RUNS_VERSION` and the transformers version, so that a run is reused only where it would come out the same."""

    def __init__(self, folder: Path):
        self.folder, self.used = folder, {}
        folder.mkdir(parents=True, exist_ok=True)

    def get(self, key: str, settings: dict, train: Callable[[], dict]) -> dict:
        stamp = [key, settings, RUNS_VERSION, transformers.__version__]
        stamp = hashlib.sha1(json.dumps(stamp, sort_keys=True, default=str).encode()).hexdigest()[:12]
        path = self.folder / f"{key.replace('/', '_').replace(' ', '_')}-{stamp}.json"
        if path.exists():
            result = json.loads(path.read_text())
        else:
            start = time.perf_counter()
            result = train()
            result["run_wall_seconds"] = time.perf_counter() - start  # training and every measure of this run
            write_json(result, path)
        self.used[path.name] = result
        return result


def _model(name: str, configs: dict[str, StemConfig], seed: int) -> torch.nn.Module:
    """A fresh model of `name` (a lab config's name, `MoE`, `hash MoE` or an ablation) initialized from `seed`; the hash
    MoE's routes are the same for every seed (a fixed hash)."""
    torch.manual_seed(seed)
    if name == "MoE":
        return MixtralForCausalLM(moe_config(configs["dense"]))
    if name == "hash MoE":
        return build_hash_moe(configs["dense"], seed=0)
    if name in ABLATED:
        where = ABLATED[name]
        return build_variant(variant_config(configs["STEM-full"], configs["dense"], where), where)
    return StemForCausalLM(configs[name])


class LabClaims:
    """The lab's world (one, seed 0, for every seed: a seed draws the initialization and the training documents, the
    facts stay), its tokenizer, the knowledge probes, the validation sets and the runs trained on them.

    Validation has two sets: `text`, held-out general text (documents no training block comes from), and `facts`,
    fresh documents of the world without general text (new orders and template draws of the facts the models are
    meant to learn: a measure of learning the world, not of generalization)."""

    def __init__(self, settings: ClaimsSettings, out: Path, texts: dict[str, list[str]], cache: RunCache):
        self.settings, self.out, self.texts, self.cache = settings, out, texts, cache
        lab = settings.lab
        self.world = make_world(lab.people, seed=0)
        self.tokenizer = build_tokenizer(self.world, texts["calibration"], lab.general_words)
        n = settings.valid_blocks // 2
        facts = replace(lab, seed=10_000, steps=max(1, n // lab.batch_size), general_share=0.0)
        valid = {
            "text": token_blocks(self.tokenizer, texts["heldout"], lab.context, n),
            "facts": Blocks(self.world, self.tokenizer, [], facts).data[:n],
        }
        self.probes = Probes(probes(self.world, self.tokenizer, "person", "train"), valid, settings.probe_every)
        self.configs = lab_configs(lab, len(self.tokenizer))
        if settings.protocol == "paper":  # dense's shape for every model: STEM saves its up-projections' FLOPs
            width = self.configs["dense"].intermediate_size
            self.configs = {k: replace(c, intermediate_size=width) for k, c in self.configs.items()}
        self._data: dict[int, Blocks] = {}

    def data(self, seed: int) -> Blocks:
        if seed not in self._data:
            lab = replace(self.settings.lab, seed=seed)
            self._data[seed] = Blocks(self.world, self.tokenizer, self.texts["calibration"], lab)
        return self._data[seed]

    def run(self, name: str, lr: float, seed: int) -> dict:
        lab = replace(self.settings.lab, lr=lr, seed=seed)

        def train() -> dict:
            model = _model(name, self.configs, seed)
            result = train_model(model, self.data(seed), lab, self.out / "trainer", self.probes)
            valid = torch.cat(list(self.probes.valid.values()))
            if isinstance(model, MixtralForCausalLM):
                result["expert_load"] = expert_load(model, valid)
            elif is_hash_moe(model):
                result["expert_load"] = hash_expert_load(model, valid)
            return result

        key = f"{name} lr={lr:g} seed={seed}" + (" paper" if self.settings.protocol == "paper" else "")
        depends = {"lab": asdict(lab), "valid_blocks": self.settings.valid_blocks, "every": self.settings.probe_every}
        return with_spikes(self.cache.get(key, depends, train))


def with_spikes(run: dict) -> dict:
    """`run` with the spike rule applied to its monitor curve (computed here, so a new rule needs no retraining) and
    its final recall and losses."""
    run["spikes"] = loss_spikes(run["monitor_loss"])
    run["spike_losses"] = [run["monitor_loss"][t] for t in run["spikes"]]
    run["final_recall"] = run["probes"][-1]["recall"]
    run["final_loss"] = run["probes"][-1]["loss"]
    return run


def _stats(values: list[float | None]) -> dict:
    values = [v for v in values if v is not None]
    spread = stdev(values) if len(values) > 1 else None
    return {"mean": mean(values) if values else None, "std": spread, "n": len(values), "values": values}


def diverged(run: dict, factor: float = 1.2) -> bool:
    """The run ended with a non-finite validation loss, or above `factor` times the best it reached."""
    losses = [sum(p["loss"].values()) for p in run["probes"]]
    return not all(math.isfinite(v) for v in losses) or losses[-1] > factor * min(losses)


def _stability_row(runs: list[dict]) -> dict:
    row = {
        **{f"final_{k}_loss": _stats([r["final_loss"][k] for r in runs]) for k in runs[0]["final_loss"]},
        "final_recall": _stats([r["final_recall"] for r in runs]),
        "spikes": [len(r["spikes"]) for r in runs],
        "diverged": [diverged(r) for r in runs],
        "active_params_per_token": runs[0]["active_params_per_token"],
        "total_params": runs[0]["total_params"],
        "train_seconds": _stats([r["train_seconds"] for r in runs]),
    }
    if "expert_load" in runs[0]:
        row["expert_max_over_mean"] = _stats([mean(r["expert_load"]["max_over_mean"]) for r in runs])
        row["idle_experts"] = [sum(r["expert_load"]["idle_experts"]) for r in runs]
    return row


def stability(claims: LabClaims, bar: tqdm) -> tuple[dict, dict]:
    """Every headline model at every learning rate; returns the table and the runs (for the plots and the ROI)."""
    s = claims.settings
    table, runs = {}, {}
    for lr in s.lrs:
        seeds = s.seeds if lr == s.lrs[0] else s.seeds[: s.other_lr_seeds]
        table[f"{lr:g}"] = {}
        for name in s.headline:
            done = []
            for seed in seeds:
                bar.set_postfix_str(f"{name} lr={lr:g} seed={seed}")
                done.append(claims.run(name, lr, seed))
                runs[(name, lr, seed)] = done[-1]
                bar.update()
            table[f"{lr:g}"][name] = _stability_row(done)
    return table, runs


def flops_to_reach(run: dict, target: float, measure: str = "recall") -> float | None:
    """Training FLOPs at which the probes first reach `target`: recall at or above it (`measure="recall"`), or a loss
    of the named validation set at or below it; linear between probe points (the first is before training)."""
    sign = 1.0 if measure == "recall" else -1.0
    value = (lambda p: p["recall"]) if measure == "recall" else (lambda p: p["loss"][measure])
    points = [(p["tokens"] * run["train_flops_per_token"], sign * value(p)) for p in run["probes"]]
    goal = sign * target
    for (f0, v0), (f1, v1) in zip(points, points[1:], strict=False):
        if v1 >= goal:
            return f0 + (f1 - f0) * (goal - v0) / (v1 - v0) if v0 < goal else f0
    return None


def roi(runs: dict, settings: ClaimsSettings, targets: tuple[float, ...] = (0.5, 0.9)) -> dict:
    """At the lab's rate, per seed, for STEM-1/2 and STEM-full against dense: recall per training FLOP over dense's
    (the paper's ROI), dense's training FLOPs over STEM's to reach each recall target, and to reach dense's own final
    loss on each validation set."""
    lr = settings.lrs[0]
    result = {}
    for name in ("STEM-1/2", "STEM-full"):
        per_seed: dict[str, list] = {"roi": [], "flops_ratio": []}
        for seed in settings.seeds:
            d, s = runs[("dense", lr, seed)], runs[(name, lr, seed)]
            per_seed["flops_ratio"].append(s["train_flops_per_token"] / d["train_flops_per_token"])
            per_unit = [r["final_recall"] / r["train_flops_per_token"] for r in (s, d)]
            per_seed["roi"].append(per_unit[0] / per_unit[1] if per_unit[1] else None)
            goals = [(f"recall_{t:g}", t, "recall") for t in targets]
            goals += [(f"dense_final_{k}_loss", v, k) for k, v in d["final_loss"].items()]
            for label, target, measure in goals:
                fd, fs = flops_to_reach(d, target, measure), flops_to_reach(s, target, measure)
                per_seed.setdefault(f"dense_flops_over_stem_to_{label}", []).append(fd / fs if fd and fs else None)
        result[name] = {k: _stats(v) for k, v in per_seed.items()}
    return result


def ablations(claims: LabClaims, bar: tqdm) -> dict:
    """The table at each other place, against STEM-full and dense, at the lab's rate."""
    s = claims.settings
    lr, seeds = s.lrs[0], s.seeds[: s.ablation_seeds]
    table = {}
    for name in ("dense", "STEM-full", *ABLATED):
        done = []
        for seed in seeds:
            bar.set_postfix_str(f"{name} seed={seed}")
            done.append(claims.run(name, lr, seed))
            bar.update(name in ABLATED)
        table[name] = _stability_row(done)
        table[name]["intermediate_size"] = done[0]["intermediate_size"]
    return table


def long_context(settings: ClaimsSettings, out: Path, texts: dict[str, list[str]], cache: RunCache, bar: tqdm) -> dict:
    """Dense and STEM-full trained on the registry text at `settings.long_context`: loss by position on held-out
    blocks, and the table parameters a context of each length activates (distinct tokens x STEM layers x d_ff)."""
    lab = replace(
        settings.lab, context=settings.long_context, batch_size=settings.long_batch_size, seed=settings.seeds[0]
    )
    texts = {split: pieces[: settings.long_text_pieces] for split, pieces in texts.items()}
    tokenizer = train_tokenizer(texts["calibration"], settings.long_vocab_size)
    train = token_blocks(tokenizer, texts["calibration"], lab.context)
    valid = token_blocks(tokenizer, texts["heldout"], lab.context, settings.long_valid_blocks)
    dense, stem = pretrain_configs(replace(lab, stem_layers="full"), len(tokenizer))
    result = {"context": lab.context, "train_tokens": lab.steps * lab.batch_size * lab.context, "models": {}}
    for name, config in (("dense", dense), ("STEM-full", stem)):
        bar.set_postfix_str(f"{name} context {lab.context}")

        def run(config=config) -> dict:
            torch.manual_seed(lab.seed)
            model = StemForCausalLM(config)
            probes = Probes([], {"text": valid}, settings.probe_every)
            r = train_model(model, TokenBlocks(train), lab, out / "trainer", probes)
            r["loss_by_position"] = loss_by_position(token_losses(model, valid))
            return r

        key = f"{name} context={lab.context}"
        depends = {"lab": asdict(lab), "vocab": settings.long_vocab_size, "valid": settings.long_valid_blocks}
        depends |= {"every": settings.probe_every}
        depends |= {"pieces": settings.long_text_pieces} if settings.long_text_pieces else {}
        result["models"][name] = with_spikes(cache.get(key, depends, run))
        bar.update()
    rows = len(stem.stem_layers) * stem.intermediate_size
    lengths = [n for n in (8, 16, 32, 64, 128, 256, 512, 1024) if n <= lab.context]
    result["activated"] = activated_parameters(valid.flatten(), lengths, rows)
    result["dense_ffn_params"] = 3 * dense.hidden_size * dense.intermediate_size * dense.num_hidden_layers
    for entry in result["activated"].values():
        entry["over_dense_ffn_params"] = entry["activated_table_params"] / result["dense_ffn_params"]
    d, s = (result["models"][k]["loss_by_position"] for k in ("dense", "STEM-full"))
    result["dense_minus_stem_by_position"] = {k: d[k] - s[k] for k in d}
    return result


def run_claims(
    settings: ClaimsSettings, out: str | Path, texts: dict[str, list[str]], parts: tuple[str, ...] | None = None
) -> dict:
    """Runs the `parts` (default all: stability, which gives the ROI too, ablations, long_context) and returns their
    results."""
    parts = parts or (("stability",) if settings.protocol == "paper" else ("stability", "ablations", "long_context"))
    if settings.protocol == "paper" and set(parts) - {"stability"}:
        raise ValueError(f"the paper protocol runs the stability part (and the ROI) only, not {sorted(parts)}")
    out = Path(out)
    start = time.perf_counter()
    n_stability = len(settings.headline) * (len(settings.seeds) + settings.other_lr_seeds * (len(settings.lrs) - 1))
    total = n_stability * bool("stability" in parts)
    total += len(ABLATED) * settings.ablation_seeds * ("ablations" in parts) + 2 * ("long_context" in parts)
    result = {"settings": asdict(settings)}
    with tqdm(total=total, desc="paper claims", unit="run") as bar:
        cache = RunCache(out / "runs")
        claims = LabClaims(settings, out, texts, cache)
        result["world"] = {"people": settings.lab.people, "vocab_size": len(claims.tokenizer)}
        if "stability" in parts:
            result["stability"], runs = stability(claims, bar)
            result["roi"] = roi(runs, settings)
            result["runs"] = {f"{n} lr={lr:g} seed={s}": r for (n, lr, s), r in runs.items()}
        if "ablations" in parts:
            result["ablations"] = ablations(claims, bar)
        if "long_context" in parts:
            result["long_context"] = long_context(settings, out, texts, cache, bar)
    result["wall_seconds"] = time.perf_counter() - start
    # What a run without the cache takes: every run's training and measures (the setup aside).
    result["compute_seconds"] = sum(r["run_wall_seconds"] for r in cache.used.values())
    return result


__all__ = [
    "ABLATED",
    "HEADLINE",
    "PAPER_HEADLINE",
    "PROTOCOLS",
    "QUICK_CLAIMS",
    "RUNS_VERSION",
    "ClaimsSettings",
    "LabClaims",
    "RunCache",
    "ablations",
    "diverged",
    "flops_to_reach",
    "long_context",
    "paper_protocol",
    "roi",
    "run_claims",
    "stability",
    "with_spikes",
]
