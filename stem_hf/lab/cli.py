"""`stem-hf lab`: trains the lab's STEM model (and dense baselines) on a synthetic world, measures recall and edits,
and saves the editable model with its tokenizer and fact table."""

import argparse
import dataclasses
import json
from pathlib import Path

from ..cli_args import int_at_least, positive_int

RESULTS = "results.json"


def add_parser(commands) -> None:
    lab = commands.add_parser("lab", help="knowledge lab: small models trained on synthetic facts; recall, edits")
    lab.add_argument("--out", default="runs/lab", help="results, plots and the editable model (OUT/editable)")
    # Parsing imports nothing heavy: the defaults named here live in stem_hf.lab.train.
    lab.add_argument("--quick", action="store_true", help="the test size (stem_hf.lab.train.QUICK)")
    lab.add_argument("--people", type=int_at_least(2), help="people in the world (default: LabSettings.people)")
    lab.add_argument("--steps", type=positive_int, help="training steps (default: LabSettings.steps)")
    lab.add_argument(
        "--regimes", nargs="+",
        help="STEM-full training regimes: plain, shared-embedding, entity-dropout-P (default: DEFAULT_REGIME)",
    )  # fmt: skip
    lab.add_argument(
        "--models", nargs="*", default=["dense"], choices=["dense", "STEM-1/2", "STEM-full"],
        help="models also trained the plain way, for comparison (default: %(default)s)",
    )  # fmt: skip
    lab.add_argument("--pairs", type=positive_int, default=200, help="edit pairs of each kind (default: %(default)s)")
    lab.add_argument(
        "--capacity", nargs="*", type=int_at_least(2), default=[], help="more world sizes for the capacity curve"
    )
    lab.add_argument("--overwrite", action="store_true", help=f"replace an OUT that already holds {RESULTS}")


def run(args: argparse.Namespace) -> None:
    from .plots import plot_all, require_matplotlib
    from .run import check_lab_args, general_text, run_lab, write_json
    from .train import DEFAULT_REGIME, QUICK, LabSettings

    args.regimes = args.regimes or [DEFAULT_REGIME]
    try:
        check_lab_args(args.regimes, args.models, args.capacity, args.pairs)
        require_matplotlib()
    except (ValueError, ImportError) as error:
        raise SystemExit(f"stem-hf {error}") from None
    out = Path(args.out)
    if (out / RESULTS).exists() and not args.overwrite:
        raise SystemExit(
            f"stem-hf lab: {out} already holds {RESULTS}; pass --overwrite to replace it, or another --out"
        )
    settings = QUICK if args.quick else LabSettings()
    overrides = {k: v for k, v in (("people", args.people), ("steps", args.steps)) if v is not None}
    settings = dataclasses.replace(settings, **overrides)
    result = run_lab(
        settings, out, general_text(), tuple(args.regimes), tuple(args.models), tuple(args.capacity), args.pairs
    )
    plot_all(result, out)
    write_json(result, out / RESULTS)
    summary = {
        name: {
            "recall": run["recall"]["person_train"]["recall"],
            "heldout_recall": run["recall"]["person_heldout"]["recall"],
            **{k: v["efficacy"] for k, v in run["edits"]["methods"].items()},
        }
        for name, run in result["runs"].items()
    }
    print(json.dumps({"runs": summary, "best_for_editing": result["best_for_editing"]}, indent=2))
    print(f"results in {out / RESULTS}; the editable model in {result.get('editable_checkpoint')}")


__all__ = ["add_parser", "run"]
