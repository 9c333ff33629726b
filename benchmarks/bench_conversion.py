"""SmolLM2-135M converted to STEM with each table initialization: held-out perplexity next to the dense model's, before
healing, and along healing runs from the best init and from xavier. Prints JSON and saves a PNG of the healing curves.

Usage: python benchmarks/bench_conversion.py [--ratios 1/3 1/2] [--inits fitted ...] [--heal-tokens N]
       [--heal-ratios 1/3] [--heal-precisions fp32 bf16] [--plot PNG] [--json PATH]
       python benchmarks/bench_conversion.py --replot RUN.json [RUN.json ...] --plot PNG

Calibration text and held-out text are disjoint documents of the bundled corpus (stem_hf/assets.py); healing runs on
the calibration corpus's text that follows the calibration tokens.
A healing curve is one run of `--heal-tokens` tokens, evaluated on the held-out text at `--eval-every` tokens once the
W_up blend is annealed out (before that the model still borrows the dense up-projection). With several
`--heal-precisions`, each start heals once per precision from copies of the same converted model, side by side; held-out
perplexities are always scored in fp32, while a curve's `kl` is the training KL, computed in the run's precision.
"""

import argparse
import copy
import json
import os
import time

import torch

from stem_hf.assets import corpora, smollm2_gguf
from stem_hf.conversion import convert, load_source
from stem_hf.conversion.heal import ANNEAL, heal
from stem_hf.conversion.report import perplexity
from stem_hf.conversion.text import calibration_and_healing_chunks, chunk_texts

# convert() options of each variant. `fitted` refits every output projection from the first STEM layer on, layer by
# layer along the residual stream, and trains the gates locally on the way (the defaults); "fitted-no-local" skips the
# local training, "fitted-sequential" refits only the STEM layers' W_down (and trains their gates), "fitted-plain"
# refits them on the dense model's activations, "fitted-rows" not at all: the ablations of those steps.
# "fitted-context" adds `--prior-context " the"`: rare and unseen tokens' rows lean on a fallback from the embedding and
# the dense FFN input after `[BOS, " the", t]`.
VARIANTS = {
    "fitted": {"init": "fitted"},
    "fitted-context": {"init": "fitted", "prior_context": " the"},
    "fitted-no-local": {"init": "fitted", "gate_epochs": 0, "dense_epochs": 0},
    "fitted-sequential": {"init": "fitted", "refit": "sequential"},
    "fitted-plain": {"init": "fitted", "refit": "plain"},
    "fitted-rows": {"init": "fitted", "refit": "none"},
    "mean": {"init": "mean"},
    "projected": {"init": "projected"},
    "xavier": {"init": "xavier"},
}


# What a healing run's summary repeats from `heal`'s report: its settings, not its timings (measured here without the
# held-out evaluations).
HEAL_FACTS = ("heal_train", "heal_anneal", "heal_table_lr", "heal_lr", "heal_rows", "heal_precision")


def tokens_to_reach(curve: list[dict], ratio: float) -> int | None:
    return next((point["tokens"] for point in curve if point["over_dense"] <= ratio), None)


def plot(runs: list[tuple[str, dict]], dense_ppl: float, path: str) -> None:
    """Healing curves of `runs`: `(label suffix, healing run)` pairs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for suffix, run in runs:
        points = [(0, run["before"])] + [(p["tokens"], p["over_dense"]) for p in run["curve"]]
        precision = f", {run['heal_precision']}" if run.get("heal_precision", "fp32") != "fp32" else ""
        label = f"STEM-{run['ratio']} from {run['init']}{precision}{suffix}"
        ax.plot(*zip(*points, strict=True), marker="o", label=label)
    for level, style in ((1.15, ":"), (1.5, "--")):
        ax.axhline(level, color="grey", linestyle=style, linewidth=1)
        ax.text(0, level, f" {level}x dense", va="bottom", color="grey", fontsize=8)
    ax.set_yscale("log")
    for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis(FormatStrFormatter("%gx"))
    ax.set_xlabel("healing tokens (KL distillation from the dense model)")
    ax.set_ylabel("held-out perplexity / dense")
    ax.set_title(f"SmolLM2-135M -> STEM: healing (dense perplexity {dense_ppl:.1f})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def replot(paths: list[str], out: str) -> None:
    """Draws the healing curves of saved runs (`--json` files) in one figure; each curve names its file when there are
    several, since an init's recipe may differ between runs."""
    runs, dense_ppl = [], None
    for path in paths:
        with open(path) as f:
            summary = json.load(f)
        dense_ppl = summary["dense_perplexity"]
        suffix = f" ({os.path.splitext(os.path.basename(path))[0]})" if len(paths) > 1 else ""
        runs += [(suffix, run) for run in summary["healing"]]
    plot(runs, dense_ppl, out)


def healing_run(dense, stem, init: str, chunks, heldout, dense_ppl: float, precision: str, args) -> dict:
    """One healing run of `args.heal_tokens` tokens, evaluated on `heldout` every `args.eval_every` tokens."""
    curve, eval_s = [], 0.0

    def evaluate(tokens: int, a: float, kl: float) -> None:
        nonlocal eval_s
        if a == 0 and tokens >= (curve[-1]["tokens"] if curve else 0) + args.eval_every:
            start = time.perf_counter()
            ppl = perplexity(stem, heldout)
            eval_s += time.perf_counter() - start
            curve.append({"tokens": tokens, "kl": round(kl, 4), "over_dense": round(ppl / dense_ppl, 3)})
            print(json.dumps(curve[-1]), flush=True)

    info = heal(
        dense,
        stem,
        chunks,
        args.heal_tokens,
        anneal=ANNEAL[init],
        train=args.heal_train,
        log_every=5,
        callback=evaluate,
        precision=precision,
    )
    final = round(perplexity(stem, heldout) / dense_ppl, 3)
    if not curve or curve[-1]["tokens"] != info["heal_tokens"]:
        curve.append({"tokens": info["heal_tokens"], "kl": round(info["heal_kl_last"], 4), "over_dense": final})
    train_s = info["heal_wall_time_s"] - eval_s
    return {
        "curve": curve,
        "final_over_dense": final,
        "tokens_to_1.5x": tokens_to_reach(curve, 1.5),
        "tokens_to_1.15x": tokens_to_reach(curve, 1.15),
        **{k: v for k, v in info.items() if k in HEAL_FACTS},
        "train_time_s": round(train_s, 1),
        "train_tokens_per_s": round(info["heal_tokens"] / train_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", nargs="+", default=["1/3", "1/2"])
    parser.add_argument("--inits", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--calibration-tokens", type=int, default=150_000)  # `stem-hf convert`'s default
    parser.add_argument("--heldout-tokens", type=int, default=10_000)
    parser.add_argument("--heal-ratios", nargs="*", default=["1/3"])
    parser.add_argument("--heal-inits", nargs="*", default=["fitted", "xavier"])
    parser.add_argument("--heal-tokens", type=int, default=90_000)
    parser.add_argument("--eval-every", type=int, default=15_000)
    parser.add_argument("--heal-train", default="all", choices=["tables", "ffn", "all"])
    parser.add_argument("--heal-precisions", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    parser.add_argument("--plot", default="benchmarks/results/healing.png", help="where the healing curves go")
    parser.add_argument("--json", help="also write the summary to this file")
    parser.add_argument("--replot", nargs="+", metavar="JSON", help="only redraw --plot from saved --json files")
    args = parser.parse_args()
    if args.replot:
        replot(args.replot, args.plot)
        return

    torch.set_flush_denormal(True)
    texts = corpora()
    dense, tokenizer = load_source(smollm2_gguf())
    bos = dense.config.bos_token_id
    heldout = chunk_texts(texts["heldout"], tokenizer, bos, 512, args.heldout_tokens)
    _, heal_chunks = calibration_and_healing_chunks(
        texts["calibration"], tokenizer, bos, 512, args.calibration_tokens, args.heal_tokens
    )
    dense_ppl = perplexity(dense, heldout)
    results, healing, kept = [], [], {}
    for ratio in args.ratios:
        for variant in args.inits:
            start = time.perf_counter()
            stem, report = convert(
                dense,
                stem_layers=ratio,
                **VARIANTS[variant],
                calibration=texts["calibration"],
                calibration_tokens=args.calibration_tokens,
                tokenizer=tokenizer,
            )
            stem_ppl = perplexity(stem, heldout)
            results.append(
                {
                    "ratio": ratio,
                    "stem_layers": report["stem_layers"],
                    "init": variant,
                    "refit": report["refit"],
                    "gate_epochs": report["gate_epochs"],
                    "dense_epochs": report["dense_epochs"],
                    "prior_context": report.get("prior_context"),
                    "perplexity": round(stem_ppl, 2),
                    "perplexity_over_dense": round(stem_ppl / dense_ppl, 3),
                    "calibration_tokens": report["calibration_tokens"],
                    "vocab_coverage": round(report["vocab_coverage"], 4),
                    "wall_time_s": round(time.perf_counter() - start, 1),
                }
            )
            print(json.dumps(results[-1]), flush=True)
            if ratio in args.heal_ratios and variant in args.heal_inits:
                kept[ratio, variant] = stem, stem_ppl / dense_ppl
            del stem

    for (ratio, variant), (stem, before) in kept.items():
        for i, precision in enumerate(args.heal_precisions):
            start = stem if i == len(args.heal_precisions) - 1 else copy.deepcopy(stem)  # the last run heals `stem`
            init = VARIANTS[variant]["init"]
            healing.append(healing_run(dense, start, init, heal_chunks, heldout, dense_ppl, precision, args))
            healing[-1].update(ratio=ratio, init=variant, before=round(before, 3))
            del start
    summary = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
        "heldout_tokens": sum(len(c) for c in heldout),
        "dense_perplexity": round(dense_ppl, 2),
        "before_healing": results,
        "healing": healing,
    }
    if healing:
        os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
        summary["plot"] = args.plot
        plot([("", run) for run in healing], dense_ppl, args.plot)
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(summary, f, indent=2)
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    main()
