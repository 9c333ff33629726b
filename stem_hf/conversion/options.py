"""What a conversion can be asked for, and the command line's defaults: one place for the CLI and the library."""

INITS = ("fitted", "mean", "projected", "xavier")
CALIBRATED_INITS = ("fitted", "mean")  # rows from calibration statistics, with a fallback for rare tokens
REFITS = ("none", "plain", "sequential", "all")
# Epochs of local training along the refit (`conversion.refit.train_gate`) when none are asked for: the gates learn
# some of what a row cannot (benchmarks/results/bench_conversion.json against bench_conversion_no_local.json).
LOCAL_EPOCHS = 5
HEAL_TRAINABLE = ("tables", "ffn", "all")
# What healing's forwards and backward compute in; "auto" takes bf16 where the device computes it natively.
HEAL_PRECISIONS = ("fp32", "bf16", "auto")
# `stem-hf convert`'s fallback context for rare and unseen tokens' rows with fitted and mean tables (`convert()` itself
# defaults to none); benchmarks/results/bench_conversion_context.json measures it against the embedding alone.
PRIOR_CONTEXT = " the"
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

__all__ = [
    "CALIBRATED_INITS",
    "DTYPE_ALIASES",
    "HEAL_PRECISIONS",
    "HEAL_TRAINABLE",
    "INITS",
    "LOCAL_EPOCHS",
    "PRIOR_CONTEXT",
    "REFITS",
    "check_epochs",
]


def check_epochs(**epochs: object) -> None:
    """Raises unless each of `epochs` (by name) is a whole number of epochs."""
    for name, value in epochs.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: {value!r} is not a whole number of epochs")
