"""The paper's remaining claims at lab scale: training stability against transformers' Mixtral MoE at three learning
rates, training ROI (knowledge-probe recall per training FLOP) over three seeds, the ablations of where the table
sits, and long context (loss by position, activated table parameters against context length).

    .venv/bin/python benchmarks/paper_claims.py             # JSON in benchmarks/results/paper_claims.json, PNGs in
                                                            # benchmarks/results/paper_claims/; about 50 min
    .venv/bin/python benchmarks/paper_claims.py --quick     # the test size, to try it (results in runs/)
    .venv/bin/python benchmarks/paper_claims.py --markdown  # the tables benchmarks/README.md quotes

Every trained run is kept in runs/paper_claims/runs/ and reused by a later call with the same settings (delete the
folder to train afresh). `stem_hf.lab.claims_run` does the work.
"""

import argparse
import json
from pathlib import Path

from stem_hf.assets import corpora
from stem_hf.lab.claims_plots import markdown, plot_claims
from stem_hf.lab.claims_run import QUICK_CLAIMS, ClaimsSettings, run_claims
from stem_hf.lab.plots import require_matplotlib
from stem_hf.lab.run import write_json

PARTS = ("stability", "ablations", "long_context")  # the ROI comes with the stability runs


def compact(result: dict, every: int = 5) -> dict:
    """The runs' per-step curves thinned to every `every`-th step (the spikes keep their steps and losses)."""
    runs = [*result.get("runs", {}).values(), *result.get("long_context", {}).get("models", {}).values()]
    for run in runs:
        for key in ("train_loss", "grad_norm", "monitor_loss"):
            run[key] = [None if v is None else round(v, 4) for v in run[key][every - 1 :: every]]
        run["curve_every"] = every
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--replot", action="store_true", help="redraw the PNGs from the saved JSON")
    parser.add_argument("--markdown", action="store_true", help="print the docs' tables from the saved JSON")
    parser.add_argument(
        "--out", default=None, help="default: benchmarks/results (runs/paper_claims_quick with --quick)"
    )
    args = parser.parse_args()
    out = args.out or ("runs/paper_claims_quick" if args.quick else "benchmarks/results")
    saved_path = Path(out) / "paper_claims.json"
    if args.replot or args.markdown:
        saved = json.loads(saved_path.read_text())
        if args.markdown:
            print(markdown(saved))
        else:
            plot_claims(saved, Path(out) / "paper_claims")
        return
    require_matplotlib()
    settings = QUICK_CLAIMS if args.quick else ClaimsSettings()
    work = "runs/paper_claims_quick" if args.quick else "runs/paper_claims"
    result = compact(run_claims(settings, work, corpora(), tuple(args.parts)))
    if set(args.parts) != set(PARTS) and saved_path.exists():  # a partial run keeps the other parts' results
        result = {**json.loads(saved_path.read_text()), **result}
    result["command"] = "python benchmarks/paper_claims.py" + (" --quick" if args.quick else "")
    plot_claims(result, Path(out) / "paper_claims")
    write_json(result, saved_path)
    print(markdown(result))


if __name__ == "__main__":
    main()
