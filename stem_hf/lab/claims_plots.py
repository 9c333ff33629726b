"""The paper-claims benchmark's PNGs and the tables benchmarks/README.md quotes, both from its saved result."""

import os
from pathlib import Path

from .plots import pyplot

COLORS = {
    "dense": "tab:blue",
    "STEM-1/2": "tab:orange",
    "STEM-full": "tab:red",
    "MoE": "tab:green",
    "hash MoE": "tab:purple",
}


def _f(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _pm(stats: dict, digits: int = 3) -> str:
    """`mean ± std` over seeds (`mean` alone for one seed)."""
    if stats["mean"] is None:
        return "n/a"
    return _f(stats["mean"], digits) + ("" if stats["std"] is None else f" ± {stats['std']:.{digits}f}")


def _row(*cells) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def _table(*header) -> list[str]:
    return ["", _row(*header), "|---|" + "---:|" * (len(header) - 1)]


def _stability_lines(result: dict) -> list[str]:
    lines = _table("learning rate", "model", "seeds", "held-out text loss", "facts loss", "probe recall",
                   "spikes per seed", "diverged", "MoE busiest expert / mean")  # fmt: skip
    for lr, models in result["stability"].items():
        for name, r in models.items():
            load = _pm(r["expert_max_over_mean"], 2) if "expert_max_over_mean" in r else ""
            losses = _pm(r["final_text_loss"]), _pm(r["final_facts_loss"])
            lines.append(_row(lr, name, r["final_recall"]["n"], *losses, _pm(r["final_recall"]),
                              " / ".join(map(str, r["spikes"])), sum(r["diverged"]), load))  # fmt: skip
    return lines


ROI_COLUMNS = {
    "dense_flops_over_stem_to_recall_0.5": "recall 0.5",
    "dense_flops_over_stem_to_recall_0.9": "recall 0.9",
    "dense_flops_over_stem_to_dense_final_facts_loss": "dense's final facts loss",
    "dense_flops_over_stem_to_dense_final_text_loss": "dense's final text loss",
}


def _roi_lines(result: dict) -> list[str]:
    lines = _table("model", "training FLOPs / dense", "ROI: recall per FLOP / dense's",
                   *(f"dense FLOPs / STEM FLOPs to {v}" for v in ROI_COLUMNS.values()))  # fmt: skip
    seeds = len(result["settings"]["seeds"])
    for name, r in result["roi"].items():
        cells = [_pm(r[k], 2) + (f" ({r[k]['n']} of {seeds} seeds)" if r[k]["n"] < seeds else "") for k in ROI_COLUMNS]
        lines.append(_row(name, _f(r["flops_ratio"]["mean"], 3), _pm(r["roi"]), *cells))
    return lines


def _ablation_lines(result: dict) -> list[str]:
    lines = _table("model", "FFN width", "active params", "total params", "held-out text loss", "facts loss",
                   "probe recall")  # fmt: skip
    for name, r in result["ablations"].items():
        sizes = f"{r['active_params_per_token'] / 1e3:.0f}k", f"{r['total_params'] / 1e6:.2f}M"
        losses = _pm(r["final_text_loss"]), _pm(r["final_facts_loss"])
        lines.append(_row(name, r["intermediate_size"], *sizes, *losses, _pm(r["final_recall"])))
    return lines


def _long_context_lines(result: dict) -> list[str]:
    lc = result["long_context"]
    models = lc["models"]
    lines = _table("positions", *(f"{k} loss" for k in models), "dense - STEM-full")
    for bucket, gap in lc["dense_minus_stem_by_position"].items():
        lines.append(_row(bucket, *(_f(m["loss_by_position"][bucket], 3) for m in models.values()), _f(gap, 3)))
    lines += _table("context length", "distinct tokens", "activated table params", "/ dense FFN params")
    for length, a in lc["activated"].items():
        lines.append(_row(length, _f(a["distinct_tokens"], 1), f"{a['activated_table_params'] / 1e6:.2f}M",
                          _f(a["over_dense_ffn_params"])))  # fmt: skip
    return lines


def markdown(result: dict) -> str:
    """The tables benchmarks/README.md quotes, from a saved result."""
    lines = []
    for part, make in (("stability", _stability_lines), ("roi", _roi_lines), ("ablations", _ablation_lines),
                       ("long_context", _long_context_lines)):  # fmt: skip
        if part in result:
            lines += make(result)
    return "\n".join(lines[1:])


def _curve(run: dict, key: str) -> tuple[list[int], list[float]]:
    every = run.get("curve_every", 1)
    return [every * (i + 1) for i in range(len(run[key]))], run[key]


def plot_stability(result: dict, path: Path) -> None:
    plt = pyplot()
    lrs = list(result["stability"])
    fig, axes = plt.subplots(1, len(lrs), figsize=(4.2 * len(lrs), 3.6), squeeze=False)
    axes = axes[0]
    for ax, lr in zip(axes, lrs, strict=True):
        for name in result["stability"][lr]:
            run = result["runs"][f"{name} lr={lr} seed={result['settings']['seeds'][0]}"]
            steps, loss = _curve(run, "monitor_loss")
            ax.plot(steps, loss, color=COLORS[name], label=f"{name} ({len(run['spikes'])} spikes)", linewidth=1)
            ax.scatter([t + 1 for t in run["spikes"]], run["spike_losses"], color=COLORS[name], marker="x", s=30)
        ax.set_title(f"learning rate {lr}, seed {result['settings']['seeds'][0]}")
        ax.set_xlabel("step")
        ax.set_ylim(0.95 * ax.dataLim.y0, min(ax.dataLim.y1, 2.5 * ax.dataLim.y0))  # the first steps' fall cut
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("loss on the held-out monitor batch")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_roi(result: dict, path: Path) -> None:
    plt = pyplot()
    lr, seeds = list(result["stability"])[0], result["settings"]["seeds"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    measures = (lambda p: p["recall"], lambda p: p["loss"]["facts"], lambda p: p["loss"]["text"])
    for name in result["stability"][lr]:  # every model whose training FLOPs are counted
        runs = [result["runs"][f"{name} lr={lr} seed={s}"] for s in seeds]
        if runs[0]["train_flops_per_token"] is None:
            continue
        flops = [p["tokens"] * runs[0]["train_flops_per_token"] for p in runs[0]["probes"]]
        for ax, measure in zip(axes, measures, strict=True):
            values = [[measure(p) for p in r["probes"]] for r in runs]
            mid = [sum(v) / len(v) for v in zip(*values, strict=True)]
            lo, hi = [min(v) for v in zip(*values, strict=True)], [max(v) for v in zip(*values, strict=True)]
            ax.plot(flops, mid, color=COLORS[name], label=f"{name} (mean of {len(seeds)} seeds; band: min-max)")
            ax.fill_between(flops, lo, hi, color=COLORS[name], alpha=0.2)
    axes[0].set_ylabel("knowledge-probe recall (trained templates)")
    axes[1].set_ylabel("loss on fresh documents of the facts")
    axes[2].set_ylabel("loss on held-out general text")
    for ax, zoom in ((axes[1], 2.0), (axes[2], 1.25)):  # the later part, where the curves differ
        ax.set_ylim(0.97 * ax.dataLim.y0, zoom * ax.dataLim.y0)
    for ax in axes:
        ax.set_xlabel("training FLOPs")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ablations(result: dict, path: Path) -> None:
    """One point per model; the bands are dense's and STEM-full's spread (mean ± std) over the seeds at the lab's rate,
    to read the single-seed ablations against."""
    plt = pyplot()
    table = result["ablations"]
    names = list(table)
    reference = result.get("stability", {}).get(next(iter(result.get("stability", {"": 0}))), {})
    keys = {"final_text_loss": "held-out text loss", "final_facts_loss": "facts loss", "final_recall": "probe recall"}
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    for ax, (key, label) in zip(axes, keys.items(), strict=True):
        for name in ("dense", "STEM-full"):
            stats = reference.get(name, {}).get(key)
            if stats and stats["std"] is not None:
                low, high = stats["mean"] - stats["std"], stats["mean"] + stats["std"]
                ax.axhspan(low, high, color=COLORS[name], alpha=0.15, label=f"{name}, {stats['n']} seeds")
        ax.plot(range(len(names)), [table[n][key]["mean"] for n in names], "o", color="black", label="seed 0")
        ax.set_xticks(range(len(names)), [n.replace("table ", "").replace(" the ", "\n") for n in names], fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_long_context(result: dict, path: Path) -> None:
    plt = pyplot()
    lc = result["long_context"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, run in lc["models"].items():
        buckets = list(run["loss_by_position"])
        axes[0].plot(buckets, list(run["loss_by_position"].values()), marker="o", color=COLORS[name], label=name)
    axes[0].set_xlabel("token position in the block")
    axes[0].set_ylabel("held-out loss")
    axes[0].legend(fontsize=8)
    lengths = [int(n) for n in lc["activated"]]
    axes[1].plot(lengths, [a["activated_table_params"] for a in lc["activated"].values()], marker="o",
                 color=COLORS["STEM-full"], label="STEM-full: table params activated")  # fmt: skip
    axes[1].set_xscale("log", base=2)
    axes[1].set_yscale("log")
    axes[1].set_xticks(lengths, [str(n) for n in lengths])
    axes[1].axhline(
        lc["dense_ffn_params"], color=COLORS["dense"], linestyle="--", label="dense: FFN params (any length)"
    )
    axes[1].set_xlabel("context length (tokens)")
    axes[1].set_ylabel("parameters")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_expert_load(result: dict, path: Path) -> None:
    plt = pyplot()
    seed = result["settings"]["seeds"][0]
    moes = [name for name in ("MoE", "hash MoE") if name in next(iter(result["stability"].values()))]
    lrs = list(result["stability"])
    fig, axes = plt.subplots(len(moes), len(lrs), figsize=(3.6 * len(lrs), 2.8 * len(moes)), squeeze=False)
    for row, name in zip(axes, moes, strict=True):
        for ax, lr in zip(row, lrs, strict=True):
            shares = result["runs"][f"{name} lr={lr} seed={seed}"]["expert_load"]["shares"]
            image = ax.imshow(shares, vmin=0, vmax=max(max(s) for s in shares), cmap="viridis", aspect="auto")
            ax.set_title(f"{name} expert load, lr {lr}, seed {seed}", fontsize=9)
            ax.set_xlabel("expert")
            ax.set_ylabel("layer")
            fig.colorbar(image, ax=ax, label="share of routed slots")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_claims(result: dict, folder: str | os.PathLike) -> list[Path]:
    """Every PNG the result has the data for, into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    plots = []
    if "stability" in result:
        plots += [(plot_stability, "stability.png"), (plot_roi, "roi.png"), (plot_expert_load, "expert_load.png")]
    if "ablations" in result:
        plots.append((plot_ablations, "ablations.png"))
    if "long_context" in result:
        plots.append((plot_long_context, "long_context.png"))
    for plot, name in plots:
        plot(result, folder / name)
    return [folder / name for _, name in plots]


__all__ = ["markdown", "plot_claims"]
