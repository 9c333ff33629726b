"""What a conversion records about itself (`conversion_report.json`, which the model card renders), and the held-out
perplexity it scores models by."""

import json
import math
import os
from dataclasses import dataclass, field, fields

import torch
from torch import nn

from ..checkpoint_stem import REPORT_FILE, SAVE_ID_KEY

__all__ = ["ConversionReport", "perplexity", "write_report"]


@torch.inference_mode()
def perplexity(model: nn.Module, chunks: list[torch.Tensor]) -> float:
    """Token-level perplexity over `chunks` (each scored from its second token)."""
    nll, count = 0.0, 0
    device = model.get_input_embeddings().weight.device
    for chunk in chunks:
        chunk = chunk.to(device)
        logits = model(chunk[None]).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / max(count, 1))


@dataclass
class ConversionReport:
    """A conversion's facts, in the order `to_dict` (the report file) lists them."""

    source: str
    source_architecture: str
    base_model: str | None
    license: str | None
    stem_layers: list[int]
    init: str
    prior_context: str | None
    refit: str
    gate_epochs: int
    dense_epochs: int
    locally_trained_layers: list[int]  # where local training lowered the layer's loss and was kept
    table_dtype: str
    # Every chunk, calibration and held-out, starts with BOS (the converted model's exact position-0 row needs it).
    bos_prepended: bool
    calibration_tokens: int
    distinct_tokens: int
    vocab_coverage: float
    calibration_data: str | None
    heldout_data: str | None
    heldout_tokens: int
    heldout_perplexity_dense: float | None
    heldout_perplexity_stem: float | None  # after healing, when there was any
    heal_text: str | None = None  # with healing: what it read
    heldout_perplexity_stem_before_healing: float | None = None
    healing: dict = field(default_factory=dict)  # `heal`'s facts, `heal_*` keys
    total_params: int = 0
    active_params_per_token: int = 0
    table_params: int = 0
    wall_time_s: float = 0.0
    save_id: str | None = None  # ties the report to the weights saved with it
    saved: bool = False

    def to_dict(self) -> dict:
        """The report as its file holds it: the fields up to the held-out perplexities as declared, then healing's
        facts (`heal_tokens` 0 without healing), sizes, ratios and timing."""
        names = [f.name for f in fields(self)]
        out = {name: getattr(self, name) for name in names[: names.index("heldout_perplexity_stem") + 1]}
        out["heal_tokens"] = 0
        if self.healing:
            out["heal_text"] = self.heal_text
            out["heldout_perplexity_stem_before_healing"] = self.heldout_perplexity_stem_before_healing
            out.update(self.healing)
        out.update(
            total_params=self.total_params,
            active_params_per_token=self.active_params_per_token,
            table_params=self.table_params,
        )
        if self.heldout_perplexity_dense:
            out["perplexity_ratio"] = self.heldout_perplexity_stem / self.heldout_perplexity_dense
            if self.healing:
                before = self.heldout_perplexity_stem_before_healing
                out["perplexity_ratio_before_healing"] = before / self.heldout_perplexity_dense
        out["wall_time_s"] = self.wall_time_s
        if self.saved:
            out[SAVE_ID_KEY] = self.save_id
        return out


def write_report(folder: str | os.PathLike, report: dict) -> None:
    """Writes `report` to `folder`'s report file, replacing any earlier one whole."""
    path = os.path.join(folder, REPORT_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=2)
    os.replace(path + ".tmp", path)
