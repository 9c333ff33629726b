"""The lab's pictures, from its result dict: recall, capacity, edits, localization, angular spread, training loss."""

import os
from pathlib import Path


def require_matplotlib() -> None:
    """Raises before any training where the plots could not be drawn at its end."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError("lab: the plots need matplotlib (pip install 'stem-hf[demo]')")


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_recall(runs: dict, path: Path) -> None:
    plt = pyplot()
    names = list(runs)
    bars = [("people, trained templates", "person_train"), ("people, held-out templates", "person_heldout"),
            ("countries, trained templates", "country_train")]  # fmt: skip
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(names)), 4))
    width = 0.8 / len(bars)
    for k, (label, key) in enumerate(bars):
        ax.bar([i + k * width for i in range(len(names))], [runs[n]["recall"][key]["recall"] for n in names], width,
               label=label)  # fmt: skip
    ax.set_xticks([i + width for i in range(len(names))], names, rotation=15, fontsize=8)
    ax.set_ylabel("exact-match recall")
    ax.set_ylim(0, 1.2)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_capacity(curve: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, points in curve.items():
        people = [p["people"] for p in points]
        axes[0].plot(people, [p["stored_bits"] / 1e3 for p in points], "o-", label=name)
        axes[1].plot(people, [p["bits_per_active_param"] for p in points], "o-", label=name)
        axes[2].plot(people, [p["bits_per_total_param"] for p in points], "o-", label=name)
    if curve:
        points = next(iter(curve.values()))
        axes[0].plot([p["people"] for p in points], [p["max_bits"] / 1e3 for p in points], "k--", label="all facts")
    for ax, label in zip(axes, ("stored kbits", "bits per active parameter", "bits per total parameter"), strict=True):
        ax.set(xscale="log", xlabel="people in the world", ylabel=label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_edits(runs: dict, path: Path) -> None:
    """Efficacy, generalization and locality of each edit method and strategy, one panel per run."""
    plt = pyplot()
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.6 * len(runs)), squeeze=False)
    for ax, (name, run) in zip(axes[:, 0], runs.items(), strict=True):
        methods = run["edits"]["methods"]
        keys = list(methods)
        for k, measure in enumerate(("efficacy", "generalization", "locality")):
            ax.bar([i + 0.27 * k for i in range(len(keys))], [methods[m][measure] or 0 for m in keys], 0.27,
                   label=measure)  # fmt: skip
        ax.set_xticks([i + 0.27 for i in range(len(keys))], keys, fontsize=7)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{name}: {run['edits']['pairs']} pairs of unequal name lengths", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0, 0].legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_localization(runs: dict, path: Path) -> None:
    plt = pyplot()
    places = list(dict.fromkeys(k for run in runs.values() for k in run["localization"] if k != "people"))
    places = [p for p in places if not p.startswith("layer_")] + sorted(
        (p for p in places if p.startswith("layer_")), key=lambda p: int(p.split("_")[1])
    )
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(runs)
    for k, (name, run) in enumerate(runs.items()):
        loc = run["localization"]
        xs = [i for i, p in enumerate(places) if p in loc]
        ax.bar([x + k * width for x in xs], [loc[places[x]] for x in xs], width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(places))], places)
    ax.set_ylabel("recall of known people")
    ax.set_xlabel("entity rows replaced by their mean in ... (none: unchanged)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_loss(runs: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, run in runs.items():
        tokens, loss = zip(*run["train_loss"], strict=True)
        ax.plot(tokens, loss, label=name, linewidth=1)
    ax.set(xlabel="training tokens", ylabel="training loss (nats/token)", yscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_all(result: dict, folder: str | os.PathLike) -> list[Path]:
    """Every plot of a `run_lab` result into `folder`; the histograms are dropped from the result (the PNG has them),
    so a result read back from JSON replots all but the angular spread."""
    from ..analysis import plot_spread

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    runs = result["runs"]
    paths = [folder / n for n in ("recall.png", "edits.png", "localization.png", "loss.png")]
    plot_recall(runs, paths[0])
    plot_edits(runs, paths[1])
    plot_localization(runs, paths[2])
    plot_loss(runs, paths[3])
    if result.get("capacity") and len(next(iter(result["capacity"].values()))) > 1:
        paths.append(folder / "capacity.png")
        plot_capacity(result["capacity"], paths[-1])
    for name, s in result.get("angular_spread", {}).items():
        if "histograms" not in s:  # a result read back from its JSON: the spread PNGs stay as they were
            continue
        paths.append(folder / f"spread_{name.replace(' ', '_').replace('/', '-')}.png")
        plot_spread(s["histograms"]["stem"], s["histograms"]["dense"], str(paths[-1]))
        del s["histograms"]
    return paths


__all__ = [
    "pyplot",
    "require_matplotlib",
    "plot_all",
    "plot_capacity",
    "plot_edits",
    "plot_localization",
    "plot_loss",
    "plot_recall",
]
