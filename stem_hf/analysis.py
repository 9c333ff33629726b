"""The paper's analyses as tools: the angular spread of STEM table rows next to that of dense up-projection outputs, and
how many table parameters a context activates as it grows. Each returns JSON-ready numbers; `plot_*` write PNGs."""

import torch
from torch import nn

from .extras import require


def angular_spread(vectors: torch.Tensor, pairs: int = 20_000, seed: int = 0) -> dict:
    """|cos| between `pairs` random pairs of distinct rows of `vectors` `[n, d]` (L2-normalized; zero rows dropped):
    the mean, median, 95th percentile, and a 50-bin histogram over [0, 1]."""
    vectors = vectors.detach().float()
    vectors = vectors[vectors.norm(dim=1) > 0]
    n = vectors.shape[0]
    if n < 2:
        raise ValueError(f"angular_spread: needs at least 2 nonzero rows, got {n}")
    unit = nn.functional.normalize(vectors, dim=1)
    g = torch.Generator().manual_seed(seed)
    i = torch.randint(0, n, (pairs,), generator=g)
    j = (i + torch.randint(1, n, (pairs,), generator=g)) % n  # never i itself
    cos = (unit[i] * unit[j]).sum(dim=1).abs().clamp(max=1.0)
    return {
        "rows": n,
        "pairs": pairs,
        "mean_abs_cos": cos.mean().item(),
        "median_abs_cos": cos.median().item(),
        "p95_abs_cos": torch.quantile(cos, 0.95).item(),
        "histogram": torch.histc(cos, bins=50, min=0.0, max=1.0).tolist(),
    }


def table_spread(model: nn.Module, token_ids: torch.Tensor, pairs: int = 20_000) -> dict[int, dict]:
    """`angular_spread` of each STEM layer's rows for the distinct `token_ids` (say, the tokens of a text)."""
    ids = torch.unique(token_ids.reshape(-1))
    return {
        int(layer): angular_spread(table.weight[ids.to(table.weight.device)], pairs)
        for layer, table in model.base_model.stem_tables.items()
    }


@torch.no_grad()
def dense_up_spread(dense: nn.Module, chunks: list[torch.Tensor], layers: list[int], pairs: int = 20_000) -> dict:
    """`angular_spread` of the up-projection outputs `W_up x` of a dense Llama-family model at `layers`, over every
    position of `chunks` (1-D token id tensors): what a STEM table row replaces, computed on the same kind of text."""
    outputs: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    hooks = [
        dense.model.layers[layer].mlp.up_proj.register_forward_hook(
            lambda _m, _args, out, layer=layer: outputs[layer].append(out[0, 1:].float().cpu())  # position 0: the sink
        )
        for layer in layers
    ]
    try:
        for chunk in chunks:
            dense(chunk[None].to(dense.device))
    finally:
        for hook in hooks:
            hook.remove()
    return {layer: angular_spread(torch.cat(outputs[layer]), pairs) for layer in layers}


def activated_parameters(
    token_stream: torch.Tensor, lengths: list[int], rows_per_token: int, windows: int = 64
) -> dict:
    """Mean table parameters a context of each length activates: distinct tokens in windows of that length (taken
    evenly along `token_stream`) x `rows_per_token` (STEM layers x intermediate size). A dense FFN activates the same
    parameters whatever the context; a STEM model's active table memory grows with the distinct tokens it reads."""
    stream = token_stream.reshape(-1)
    result = {}
    for length in lengths:
        if length > len(stream):
            break
        starts = torch.linspace(0, len(stream) - length, min(windows, len(stream) - length + 1)).long()
        distinct = [len(torch.unique(stream[s : s + length])) for s in starts.tolist()]
        mean = sum(distinct) / len(distinct)
        result[str(length)] = {"distinct_tokens": mean, "activated_table_params": mean * rows_per_token}
    return result


def plot_spread(stem: dict[int, dict], dense: dict[int, dict] | None, path: str) -> None:
    matplotlib = require("matplotlib")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    centers = [(i + 0.5) / 50 for i in range(50)]
    for name, stats, color in (("STEM table rows", stem, "tab:orange"), ("dense W_up x", dense or {}, "tab:blue")):
        for k, (_, s) in enumerate(sorted(stats.items())):
            total = sum(s["histogram"]) or 1
            axes[0].plot(
                centers, [c / total for c in s["histogram"]], color=color, alpha=0.35 + 0.65 * k / max(len(stats), 1)
            )
        if stats:
            axes[0].plot([], [], color=color, label=name)
            layers = sorted(stats)
            axes[1].plot(layers, [stats[layer]["p95_abs_cos"] for layer in layers], "o-", color=color, label=name)
    axes[0].set_xlabel("|cos| between two rows")
    axes[0].set_ylabel("share of pairs (one line per layer)")
    axes[0].legend()
    axes[1].set_xlabel("layer")
    axes[1].set_ylabel("95th percentile of |cos|")
    axes[1].legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_activated(activated: dict, dense_ffn_params: int, path: str) -> None:
    matplotlib = require("matplotlib")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [int(k) for k in activated]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(lengths, [activated[str(n)]["activated_table_params"] / 1e6 for n in lengths], "o-", label="STEM tables")
    ax.axhline(dense_ffn_params / 1e6, color="tab:blue", linestyle="--", label="up-projections they replace")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("activated parameters (M)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


__all__ = [
    "activated_parameters",
    "angular_spread",
    "dense_up_spread",
    "plot_activated",
    "plot_spread",
    "run_analysis",
    "table_spread",
]


def run_analysis(model: nn.Module, tokenizer, texts: list[str], out: str, dense: nn.Module | None = None) -> dict:
    """Both analyses on `texts`: JSON in `out/analysis.json`, plots in `out/angular_spread.png` and
    `out/activated_parameters.png`. With `dense` (the model's dense source), its up-projection outputs at the STEM
    layers give the reference spread."""
    import json
    import os

    os.makedirs(out, exist_ok=True)
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    stream = torch.tensor([i for piece in ids for i in piece][:50_000])
    config = model.config
    result = {"tokens": len(stream), "distinct_tokens": len(torch.unique(stream))}
    result["table_spread"] = table_spread(model, stream)
    if dense is not None:
        chunks = [stream[s : s + 512] for s in range(0, min(len(stream), 8192), 512)]
        if tokenizer.bos_token_id is not None:
            chunks = [torch.cat([torch.tensor([tokenizer.bos_token_id]), c]) for c in chunks]
        result["dense_up_spread"] = dense_up_spread(dense, chunks, list(config.stem_layers))
    lengths = [2**k for k in range(4, 16) if 2**k <= len(stream)]
    rows_per_token = len(config.stem_layers) * config.intermediate_size
    result["activated"] = activated_parameters(stream, lengths, rows_per_token)
    result["dense_up_proj_params"] = len(config.stem_layers) * config.hidden_size * config.intermediate_size
    plot_spread(result["table_spread"], result.get("dense_up_spread"), os.path.join(out, "angular_spread.png"))
    plot_activated(result["activated"], result["dense_up_proj_params"], os.path.join(out, "activated_parameters.png"))
    for stats in (result["table_spread"], result.get("dense_up_spread") or {}):
        for s in stats.values():
            s.pop("histogram")  # in the PNG; the JSON keeps the summary
    with open(os.path.join(out, "analysis.json"), "w") as f:
        json.dump(result, f, indent=2)
    return result
