"""The knowledge lab's full run: dense, STEM-1/2 and STEM-full at matched active parameters trained from scratch on the
same synthetic biographies and general text; STEM-full also under each training regime; recall, capacity, edits by
rows against their baselines, localization and angular spread.

    .venv/bin/python benchmarks/knowledge_lab.py            # JSON in benchmarks/results/knowledge_lab.json, PNGs
                                                            # in benchmarks/results/knowledge_lab/
    .venv/bin/python benchmarks/knowledge_lab.py --quick    # the test size, to try it (results in runs/)

The editable model (STEM-full in the regime that best puts the facts in the rows) is saved with its tokenizer and
fact table in runs/knowledge_lab/editable, for `stem-hf edit` and notebook 03.
"""

import argparse
import json

from stem_hf.lab.plots import plot_all
from stem_hf.lab.run import general_text, run_lab, write_json
from stem_hf.lab.train import QUICK, REGIMES, LabSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--replot", action="store_true", help="redraw the PNGs from the saved JSON (not the spread)")
    parser.add_argument(
        "--out", default=None, help="default: benchmarks/results (runs/knowledge_lab_quick with --quick)"
    )
    args = parser.parse_args()
    settings = QUICK if args.quick else LabSettings()
    capacity = (16, 64) if args.quick else (100, 1000)
    out = args.out or ("runs/knowledge_lab_quick" if args.quick else "benchmarks/results")
    if args.replot:
        with open(f"{out}/knowledge_lab.json") as f:
            plot_all(json.load(f), f"{out}/knowledge_lab")
        return
    result = run_lab(
        settings,
        "runs/knowledge_lab_quick" if args.quick else "runs/knowledge_lab",
        general_text(),
        regimes=REGIMES,
        capacity_people=capacity,
        pairs=200,
    )
    result["command"] = "python benchmarks/knowledge_lab.py" + (" --quick" if args.quick else "")
    plot_all(result, f"{out}/knowledge_lab")
    write_json(result, f"{out}/knowledge_lab.json")
    print(json.dumps({k: result[k] for k in ("best_for_editing", "wall_seconds")}, indent=2))


if __name__ == "__main__":
    main()
