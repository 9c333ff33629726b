"""What a conversion is asked to do: its options checked, and the defaults that depend on the init resolved, before
anything loads."""

from dataclasses import dataclass, field

import torch

from .heal import ANNEAL, check_heal_options
from .options import CALIBRATED_INITS, INITS, LOCAL_EPOCHS, REFITS, check_epochs

__all__ = ["ConversionPlan"]


@dataclass
class ConversionPlan:
    """How `convert` turns a dense model into a STEM one.

    `stem_layers` ("1/3", "1/2", "full", "1/N" or layer indices) get tables of `table_dtype`, initialized by `init`
    (one of `INITS`; `conversion.init_tables`), rare tokens' rows shrunk toward a fallback with pseudo-count `shrink`.
    `prior_context` (a text, e.g. " the"; `fitted` and `mean` only): rare and unseen tokens' rows lean on a fallback
    predicted from the token's input embedding and its dense FFN input after BOS and this text
    (`conversion.calibrate.context_inputs`), not from the embedding alone. `refit` (one of `REFITS`; default `"all"`
    for `fitted`, `"none"` for the others) then refits output projections in closed form (`conversion.refit`):
    `"plain"` each STEM layer's `W_down` to the dense FFN's output on the dense model's activations; `"sequential"` the
    same, layer by layer along both models' residual streams, to bring the converted stream back to the dense one;
    `"all"` also every attention `o_proj` and dense `W_down` after the first STEM layer. `gate_epochs` (default
    `LOCAL_EPOCHS` with `"sequential"` and `"all"`) then trains each STEM layer's gate locally along the stream,
    `dense_epochs` (default `LOCAL_EPOCHS` with `"all"`) the gate and up-projection of each dense layer it refits.
    With `heal_tokens`, the initialized model is then distilled from the dense one on that many tokens of calibration
    text (`conversion.heal`), `heal_options` going to `heal` (`anneal` defaults to `ANNEAL[init]`), on `device`
    (default: where the model is; tables stay in host memory).

    `stream` (default: unless healing): a conversion with an output folder writes each block of table rows into its
    shard as it is computed (`StemTableStream`) and never holds a table in memory; healing trains the tables, so it
    cannot. Table shards hold at most `max_shard_size` bytes. `offload_store`: also write the token-major offload store
    (`stem_hf.offload.write_offload_store`) into the output folder.

    Raises on options a conversion would refuse, and resolves the defaults, before anything loads.
    """

    stem_layers: str | list[int] = "1/3"
    init: str = "fitted"
    table_dtype: str = "bfloat16"
    shrink: float = 16.0
    prior_context: str | None = None
    refit: str | None = None
    gate_epochs: int | None = None
    dense_epochs: int | None = None
    heal_tokens: int = 0
    heal_options: dict = field(default_factory=dict)
    device: str | torch.device | None = None
    stream: bool | None = None
    max_shard_size: int | str = "50GB"
    offload_store: bool = False

    def __post_init__(self) -> None:
        if self.init not in INITS:
            raise ValueError(f"init: {self.init!r} is not one of {', '.join(INITS)}")
        if self.refit is not None and self.refit not in REFITS:
            raise ValueError(f"refit: {self.refit!r} is not one of {', '.join(REFITS)}")
        if self.prior_context is not None and self.init not in CALIBRATED_INITS:
            raise ValueError(
                f"prior_context: init {self.init!r} has no fallback rows to predict (only fitted and mean do)"
            )
        self.heal_options = {"anneal": ANNEAL[self.init], **self.heal_options}
        check_heal_options(self.heal_tokens, **self.heal_options, device=self.device)
        if self.refit is None:
            self.refit = "all" if self.init == "fitted" else "none"
        self.gate_epochs, self.dense_epochs = self._local_epochs()
        if self.stream and self.heal_tokens:
            raise ValueError("stream: healing trains the tables, which needs them in memory; convert without stream")
        if self.stream is None:
            self.stream = not self.heal_tokens

    def _local_epochs(self) -> tuple[int, int]:
        """Epochs of local training for the STEM layers' gates and the dense layers' FFNs: it runs inside the refit
        along the stream, so only with `"sequential"` (gates) and `"all"` (both)."""
        allowed = {"gate_epochs": self.refit in ("sequential", "all"), "dense_epochs": self.refit == "all"}
        epochs = {"gate_epochs": self.gate_epochs, "dense_epochs": self.dense_epochs}
        for name, value in epochs.items():
            if value is None:
                epochs[name] = LOCAL_EPOCHS if allowed[name] else 0
                continue
            check_epochs(**{name: value})
            if value and not allowed[name]:
                needs = "refit 'sequential' or 'all'" if name == "gate_epochs" else "refit 'all'"
                raise ValueError(
                    f"{name}: local training runs inside the refit along the stream ({needs}), not {self.refit!r}"
                )
        return epochs["gate_epochs"], epochs["dense_epochs"]

    def check_calibration(self, stem_layers: list[int], has_text: bool) -> None:
        """Raises where this plan reads calibration text for `stem_layers` and there is none."""
        for what, needed in (
            (f"init {self.init!r}", self.init in CALIBRATED_INITS),
            (f"refit {self.refit!r}", self.refit != "none"),
        ):
            if needed and stem_layers and not has_text:
                raise ValueError(f"{what} needs calibration text (--calibration)")
