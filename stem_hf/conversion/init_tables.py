"""Table rows for a STEM layer converted from a dense one, for each initialization.

- `projected`: `W_up(norm(E[t]))`, from the token embedding alone, no calibration.
- `mean`: `W_up(E[x | t])`, the up-projection of the mean FFN input where the input token is t.
- `fitted`: per channel j, `sum(s_j^2 u_j) / sum(s_j^2)` with `s = SiLU(W_gate x)`, `u = W_up x`: the weighted
  least-squares row for the product `s * u` that feeds `W_down`.
Rare tokens are shrunk (pseudo-count `shrink`) toward, and unseen tokens get, a fallback: the up-projection of a ridge
map from the token's features (its input embedding, and with a prior context its FFN input after that context) to its
mean FFN input. The BOS token gets the exact position-0 row.
"""

from collections.abc import Callable

import torch


def ridge_map(
    features: torch.Tensor, tokens: torch.Tensor, mean_x: torch.Tensor, counts: torch.Tensor, lam: float
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Affine map `[F, 1] @ A` fit by count-weighted ridge regression from the features `F` (`[vocab, n]`) of seen
    `tokens` to their mean FFN inputs. Returns a function of features."""
    features = torch.cat([features[tokens].double(), torch.ones(len(tokens), 1, dtype=torch.float64)], dim=1)
    weighted = features * counts.double()[:, None]
    gram = features.T @ weighted
    gram += lam * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=torch.float64)
    solution = torch.linalg.solve(gram, weighted.T @ mean_x.double()).float()
    return lambda e: e.float() @ solution[:-1] + solution[-1]


def _up(mlp, x: torch.Tensor) -> torch.Tensor:
    return mlp.up_proj(x)


@torch.inference_mode()
def projected_rows(layer, embed: torch.Tensor, rows: slice) -> torch.Tensor:
    return _up(layer.mlp, layer.post_attention_layernorm(embed[rows].float()))


@torch.inference_mode()
def calibrated_rows(
    mlp,
    stats,
    slots: torch.Tensor,
    fallback_x,
    features: torch.Tensor,
    rows: slice,
    init: str,
    shrink: float,
    bos_token_id: int | None,
) -> torch.Tensor:
    """Rows `rows` of the table for `init` in ("mean", "fitted"); `features`: `[vocab, n]`, what `fallback_x` maps."""
    token_ids = torch.arange(features.shape[0])[rows]
    slot = slots[rows]
    seen = slot >= 0
    prior_x = fallback_x(features[rows])  # [n, hidden]
    if init == "mean":
        count = torch.zeros(len(slot))
        sum_x = torch.zeros_like(prior_x)
        count[seen] = stats.count[slot[seen]]
        sum_x[seen] = stats.sum_x[slot[seen]]
        out = _up(mlp, (sum_x + shrink * prior_x) / (count + shrink).clamp(min=1e-12)[:, None])
        out[~seen] = _up(mlp, prior_x[~seen])
    else:
        prior = _up(mlp, prior_x)
        # The pseudo-count is in occurrences: `shrink` times the mean weight one occurrence carries, per channel.
        if stats.mean_w is None:  # once per layer, not per block of rows
            stats.mean_w = stats.sum_w.sum(0) / stats.count.sum().clamp(min=1)
        mean_w = stats.mean_w
        sum_w = torch.zeros_like(prior)
        sum_wu = torch.zeros_like(prior)
        sum_w[seen] = stats.sum_w[slot[seen]]
        sum_wu[seen] = stats.sum_wu[slot[seen]]
        out = (sum_wu + shrink * mean_w * prior) / (sum_w + shrink * mean_w).clamp(min=1e-12)
        out[~seen] = prior[~seen]
    if bos_token_id is not None and stats.first_count and rows.start <= bos_token_id < rows.stop:
        at = int((token_ids == bos_token_id).nonzero())
        if init == "mean":
            out[at] = _up(mlp, stats.first_x / stats.first_count)
        else:
            out[at] = stats.first_wu / stats.first_w.clamp(min=1e-12)
    return out
