"""The paper's remaining claims at lab scale (`benchmarks/paper_claims.py` runs them; docs in benchmarks/README.md):

- stability: dense, STEM-1/2, STEM-full and transformers' Mixtral MoE at matched active parameters, on the same
  tokens, at each learning rate of `lrs` (every seed at the first, the lab's; the first seed at the others);
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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import mean, stdev

import torch
from tqdm import tqdm
from transformers import MixtralForCausalLM

from ..analysis import activated_parameters
from ..modeling_stem import StemForCausalLM
from ..pretrain import configs as pretrain_configs
from ..pretrain import train_tokenizer
from .claims import Probes, TokenBlocks, expert_load, loss_by_position, token_losses, train_model
from .corpus import build_tokenizer, make_world
from .measure import probes
from .run import write_json
from .train import Blocks, LabSettings, lab_configs
from .variants import build_variant, moe_config, variant_config

HEADLINE = ("dense", "STEM-1/2", "STEM-full", "MoE")
ABLATED = {"table at the gate": "gate", "table added to the up": "added", "table at the down": "down"}


@dataclass
class ClaimsSettings:
    """The lab's model shape, world and schedule (`lab`), and what this benchmark adds to them."""

    lab: LabSettings = field(default_factory=LabSettings)
    seeds: tuple[int, ...] = (0, 1, 2)
    lrs: tuple[float, ...] = (3e-3, 3e-2, 1e-1)  # the lab's rate first
    ablation_seeds: int = 1
    probe_every: int = 100
    valid_blocks: int = 128
    long_context: int = 512
    long_batch_size: int = 4  # the lab's tokens per step at the long context
    long_vocab_size: int = 4096
    long_valid_blocks: int = 32


QUICK_CLAIMS = ClaimsSettings(
    lab=LabSettings(people=16, steps=12, batch_size=4, general_words=200, general_share=0.1, warmup=0.1),
    seeds=(0, 1),
    lrs=(3e-3, 3e-2),
    probe_every=4,
    valid_blocks=8,
    long_context=64,
    long_batch_size=4,
    long_vocab_size=512,
    long_valid_blocks=4,
)


class RunCache:
    """Trained runs' results as `folder/<key>.json`, keyed by the run's name and its settings."""

    def __init__(self, folder: Path):
        self.folder, self.used = folder, {}
        folder.mkdir(parents=True, exist_ok=True)

    def get(self, key: str, settings: dict, train) -> dict:
        stamp = hashlib.sha1(json.dumps([key, settings], sort_keys=True, default=str).encode()).hexdigest()[:12]
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


def _model(name: str, lab: dict, seed: int):
    torch.manual_seed(seed)
    if name == "MoE":
        return MixtralForCausalLM(moe_config(lab["dense"]))
    if name in ABLATED:
        where = ABLATED[name]
        return build_variant(variant_config(lab["STEM-full"], lab["dense"], where), where)
    return StemForCausalLM(lab[name])


class LabClaims:
    """The lab's world (one, seed 0, for every seed: seeds change initialization and data order), its tokenizer, the
    held-out validation blocks and the knowledge probes, and the runs trained on them."""

    def __init__(self, settings: ClaimsSettings, out: Path, texts: dict[str, list[str]], cache: RunCache):
        self.settings, self.out, self.texts, self.cache = settings, out, texts, cache
        lab = settings.lab
        self.world = make_world(lab.people, seed=0)
        self.tokenizer = build_tokenizer(self.world, texts["calibration"], lab.general_words)
        valid = replace(lab, seed=10_000, steps=max(1, settings.valid_blocks // lab.batch_size))
        self.probes = Probes(
            probes(self.world, self.tokenizer, "person", "train"),
            Blocks(self.world, self.tokenizer, texts["heldout"], valid).data[: settings.valid_blocks],
            settings.probe_every,
        )
        self.configs = lab_configs(lab, len(self.tokenizer))
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
            if isinstance(model, MixtralForCausalLM):
                result["expert_load"] = expert_load(model, self.probes.valid)
            return result

        key = f"{name} lr={lr:g} seed={seed}"
        return self.cache.get(key, {"lab": asdict(lab), "claims": asdict(self.settings)}, train)


def _stats(values: list[float | None]) -> dict:
    values = [v for v in values if v is not None]
    spread = stdev(values) if len(values) > 1 else None
    return {"mean": mean(values) if values else None, "std": spread, "n": len(values), "values": values}


def _stability_row(runs: list[dict]) -> dict:
    row = {
        "final_valid_loss": _stats([r["final_valid_loss"] for r in runs]),
        "final_recall": _stats([r["final_recall"] for r in runs]),
        "spikes": [len(r["spikes"]) for r in runs],
        "diverged": [
            not math.isfinite(r["final_valid_loss"]) or r["final_valid_loss"] > r["probes"][0]["valid_loss"]
            for r in runs
        ],  # fmt: skip
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
        seeds = s.seeds if lr == s.lrs[0] else s.seeds[:1]
        table[f"{lr:g}"] = {}
        for name in HEADLINE:
            done = []
            for seed in seeds:
                bar.set_postfix_str(f"{name} lr={lr:g} seed={seed}")
                done.append(claims.run(name, lr, seed))
                runs[(name, lr, seed)] = done[-1]
                bar.update()
            table[f"{lr:g}"][name] = _stability_row(done)
    return table, runs


def _flops_to_reach(run: dict, target: float) -> float | None:
    """Training FLOPs at which the probe recall first reaches `target` (linear between probe points)."""
    points = [(p["tokens"] * run["train_flops_per_token"], p["recall"]) for p in run["probes"]]
    for (f0, r0), (f1, r1) in zip([(0.0, 0.0), *points], points, strict=False):
        if r1 >= target:
            return f0 + (f1 - f0) * (target - r0) / (r1 - r0) if r1 > r0 else f1
    return None


def roi(runs: dict, settings: ClaimsSettings, targets: tuple[float, ...] = (0.5, 0.9)) -> dict:
    """Recall per training FLOP against dense's (the paper's ROI), and the training FLOPs to reach each recall
    target, at the lab's rate, per seed; STEM-1/2 and STEM-full."""
    lr = settings.lrs[0]
    dense = {seed: runs[("dense", lr, seed)] for seed in settings.seeds}
    result = {}
    for name in ("STEM-1/2", "STEM-full"):
        per_seed = {"roi": [], "flops_ratio": [], **{f"dense_flops_to_{t:g}_over_stem": [] for t in targets}}
        for seed in settings.seeds:
            d, s = dense[seed], runs[(name, lr, seed)]
            per_seed["flops_ratio"].append(s["train_flops_per_token"] / d["train_flops_per_token"])
            per_seed["roi"].append(
                (s["final_recall"] / s["train_flops_per_token"]) / (d["final_recall"] / d["train_flops_per_token"])
                if d["final_recall"]
                else None
            )
            for t in targets:
                fd, fs = _flops_to_reach(d, t), _flops_to_reach(s, t)
                per_seed[f"dense_flops_to_{t:g}_over_stem"].append(fd / fs if fd and fs else None)
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
    tokenizer = train_tokenizer(texts["calibration"], settings.long_vocab_size)

    def cut(split: str, limit: int | None = None) -> torch.Tensor:
        ids = [i for doc in tokenizer(texts[split])["input_ids"] for i in (*doc, tokenizer.eos_token_id)]
        n = len(ids) // lab.context if limit is None else limit
        return torch.tensor(ids[: n * lab.context]).view(-1, lab.context)

    train, valid = cut("calibration"), cut("heldout", settings.long_valid_blocks)
    dense, stem = pretrain_configs(replace(lab, stem_layers="full"), len(tokenizer))
    result = {"context": lab.context, "train_tokens": lab.steps * lab.batch_size * lab.context, "models": {}}
    for name, config in (("dense", dense), ("STEM-full", stem)):
        bar.set_postfix_str(f"{name} context {lab.context}")

        def run(config=config) -> dict:
            torch.manual_seed(lab.seed)
            model = StemForCausalLM(config)
            r = train_model(model, TokenBlocks(train), lab, out / "trainer", Probes([], valid, settings.probe_every))
            r["loss_by_position"] = loss_by_position(token_losses(model, valid))
            return r

        key = f"{name} context={lab.context}"
        result["models"][name] = cache.get(key, {"lab": asdict(lab), "claims": asdict(settings)}, run)
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


def run_claims(settings: ClaimsSettings, out: str | Path, texts: dict[str, list[str]], parts=None) -> dict:
    """Runs the `parts` (default all: stability, which gives the ROI too, ablations, long_context) and returns their
    results."""
    parts = parts or ("stability", "ablations", "long_context")
    out = Path(out)
    start = time.perf_counter()
    n_stability = len(HEADLINE) * (len(settings.seeds) + len(settings.lrs) - 1)
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


__all__ = ["ABLATED", "HEADLINE", "QUICK_CLAIMS", "ClaimsSettings", "LabClaims", "RunCache", "run_claims"]
