"""The paper's remaining claims at lab scale: training stability against MoEs at three learning rates, training ROI
(knowledge-probe recall per training FLOP) over three seeds, the ablations of where the table sits, and long context
(loss by position, activated table parameters against context length).

Two protocols (`stem_hf.lab.claims_run`), side by side: `matched` (STEM widened to dense's active parameters, the
stem-hf recipe, Mixtral's top-2 MoE; every part) and `paper` (every model at dense's shape, so STEM has fewer FLOPs,
the reference code's recipe, and a hash-routed fine-grained MoE beside Mixtral's; stability and ROI only).

    .venv/bin/python benchmarks/paper_claims.py                     # both: JSON in benchmarks/results/
                                                                    # paper_claims.json (matched, about 75 min) and
                                                                    # paper_claims_paper.json (paper, 25 runs),
                                                                    # PNGs and curves in the folders of those names
    .venv/bin/python benchmarks/paper_claims.py --protocol paper    # one of them
    .venv/bin/python benchmarks/paper_claims.py --quick             # the test size, to try it (results in runs/)
    .venv/bin/python benchmarks/paper_claims.py --markdown          # the tables benchmarks/README.md quotes

Every trained run is kept in runs/paper_claims/runs/ and reused by a later call with the same settings (delete the
folder to train afresh). `--parts` runs some parts and keeps the saved results of the others; the wall and compute
seconds saved are then those of that call. `stem_hf.lab.claims_run` does the work.
"""

import argparse
import json
from pathlib import Path

from stem_hf.assets import corpora
from stem_hf.lab.claims_plots import markdown, plot_claims
from stem_hf.lab.claims_run import PROTOCOLS, QUICK_CLAIMS, ClaimsSettings, paper_protocol, run_claims
from stem_hf.lab.plots import require_matplotlib
from stem_hf.lab.run import write_json

PARTS = ("stability", "ablations", "long_context")  # the ROI comes with the stability runs
CURVES = ("train_loss", "grad_norm", "monitor_loss", "spike_losses", "probes")  # per run, for the plots only


def compact(result: dict, every: int = 5) -> dict:
    """The runs' per-step curves thinned to every `every`-th step (the spikes keep their steps and losses)."""
    runs = [*result.get("runs", {}).values(), *result.get("long_context", {}).get("models", {}).values()]
    for run in runs:
        for key in ("train_loss", "grad_norm", "monitor_loss"):
            run[key] = [None if v is None else round(v, 4) for v in run[key][every - 1 :: every]]
        run["curve_every"] = every
    return result


def _runs(result: dict) -> dict:
    return {**result.get("runs", {}), **result.get("long_context", {}).get("models", {})}


def split(result: dict) -> tuple[dict, dict]:
    """The result without the runs' curves (the JSON the docs quote: no curve value can pass for a quoted figure), and
    the curves by run."""
    curves = {key: {k: run.pop(k) for k in CURVES if k in run} for key, run in _runs(result).items()}
    return result, curves


def merge(result: dict, curves: dict) -> dict:
    for key, run in _runs(result).items():
        run.update(curves.get(key, {}))
    return result


def paths(out: Path, protocol: str) -> tuple[Path, Path]:
    """The saved result and its curves for `protocol` (the matched protocol keeps the original names)."""
    name = "paper_claims" if protocol == "matched" else f"paper_claims_{protocol}"
    return out / f"{name}.json", out / name / "curves.json"


def run_protocol(protocol: str, args: argparse.Namespace, out: Path) -> None:
    saved_path, curves_path = paths(out, protocol)
    if args.replot or args.markdown:
        saved = json.loads(saved_path.read_text())
        if args.markdown:
            print(f"\n{protocol} protocol\n" + markdown(saved))
        else:
            plot_claims(merge(saved, json.loads(curves_path.read_text())), curves_path.parent)
        return
    settings = QUICK_CLAIMS if args.quick else ClaimsSettings()
    parts = tuple(args.parts or PARTS)
    if protocol == "paper":
        settings, parts = paper_protocol(settings), ("stability",)
    work = "runs/paper_claims_quick" if args.quick else "runs/paper_claims"
    result = compact(run_claims(settings, work, corpora(), parts))
    if set(parts) != set(PARTS) and protocol == "matched" and saved_path.exists():  # a partial run keeps the rest
        saved = merge(json.loads(saved_path.read_text()), json.loads(curves_path.read_text()))
        result = {**saved, **result}
    result["command"] = f"python benchmarks/paper_claims.py --protocol {protocol}" + (" --quick" if args.quick else "")
    plot_claims(result, curves_path.parent)
    result, curves = split(result)
    write_json(curves, curves_path)
    write_json(result, saved_path)
    print(f"\n{protocol} protocol\n" + markdown(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--protocol", choices=(*PROTOCOLS, "both"), default="both")
    parser.add_argument("--parts", nargs="+", choices=PARTS, help="of the matched protocol (default: all)")
    parser.add_argument("--replot", action="store_true", help="redraw the PNGs from the saved JSON")
    parser.add_argument("--markdown", action="store_true", help="print the docs' tables from the saved JSON")
    parser.add_argument(
        "--out", default=None, help="default: benchmarks/results (runs/paper_claims_quick with --quick)"
    )
    args = parser.parse_args()
    if args.parts and args.protocol == "paper":
        parser.error("--parts: the paper protocol runs the stability part (and the ROI) only")
    if not (args.replot or args.markdown):
        require_matplotlib()
    out = Path(args.out or ("runs/paper_claims_quick" if args.quick else "benchmarks/results"))
    for protocol in PROTOCOLS if args.protocol == "both" else (args.protocol,):
        run_protocol(protocol, args, out)


if __name__ == "__main__":
    main()
