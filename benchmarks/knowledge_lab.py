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

from stem_hf.lab.plots import plot_all, require_matplotlib
from stem_hf.lab.run import general_text, run_lab, write_json
from stem_hf.lab.train import QUICK, REGIMES, LabSettings


def _row(*cells) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def _table(*header) -> list[str]:
    return ["", _row(*header), "|---|" + "---:|" * (len(header) - 1)]


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def markdown(result: dict) -> str:
    """The tables docs/knowledge_lab.md quotes, from a saved result."""
    runs = result["runs"]
    lines = _table("model", "active params", "total params", "recall, trained templates", "held-out templates",
                   "countries (trained / held-out)", "stored bits")  # fmt: skip
    for name, r in runs.items():
        rc = {k: _f(v["recall"]) for k, v in r["recall"].items() if isinstance(v, dict)}
        lines.append(_row(name, f"{r['active_params_per_token'] / 1e3:.0f}k", f"{r['total_params'] / 1e6:.2f}M",
                          rc["person_train"], rc["person_heldout"], f"{rc['country_train']} / {rc['country_heldout']}",
                          f"{r['recall']['stored_bits']:.0f}"))  # fmt: skip
    lines += _table("model", "edit", "efficacy", "generalization", "divergence closed", "locality",
                    "locality, shared name word")  # fmt: skip
    for name, r in runs.items():
        for method, m in r["edits_same_length"]["methods"].items():
            keys = ("efficacy", "generalization", "divergence_closed", "locality", "locality_shared_name_token")
            lines.append(_row(name, method, *(_f(m.get(k)) for k in keys)))
    unequal = [k for k in runs["STEM-full"]["edits"]["methods"] if k != "text"]
    lines += _table("model", *unequal)
    for name, r in runs.items():
        lines.append(_row(name, *(_f(r["edits"]["methods"][k]["efficacy"]) if k in r["edits"]["methods"] else ""
                                  for k in unequal)))  # fmt: skip
    countries = list(runs["STEM-full"]["country_edits"]["methods"])  # `.../pad` in results saved before `clone`
    lines += _table("model", *countries)
    for name, r in runs.items():
        m = r["country_edits"]["methods"]
        lines.append(_row(name, *(_f(m[k]["efficacy"]) if k in m else "" for k in countries)))
    places = ["none", "embedding", "tables", "layer_1", "layer_2", "layer_3"]
    lines += _table("model", *places)
    for name, r in runs.items():
        lines.append(_row(name, *(_f(r["localization"][p]) if p in r["localization"] else "" for p in places)))
    sizes = [p["people"] for p in next(iter(result["capacity"].values()))]
    lines += _table("model", *(f"{n} people" for n in sizes))
    for name, points in result["capacity"].items():
        lines.append(_row(name, *(f"{p['recall']:.2f} ({p['stored_bits'] / 1e3:.1f} kbit)" for p in points)))
    spreads = result["angular_spread"]
    lines += _table("layer", *spreads, "dense W_up x")
    first = next(iter(spreads.values()))["per_layer"]
    for layer in first["stem"]:
        cells = [_f(s["per_layer"]["stem"][layer]["p95_abs_cos"]) for s in spreads.values()]
        lines.append(_row(layer, *cells, _f(first["dense"][layer]["p95_abs_cos"])))
    return "\n".join(lines[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--replot", action="store_true", help="redraw the PNGs from the saved JSON (not the spread)")
    parser.add_argument("--markdown", action="store_true", help="print the docs' tables from the saved JSON")
    parser.add_argument(
        "--out", default=None, help="default: benchmarks/results (runs/knowledge_lab_quick with --quick)"
    )
    args = parser.parse_args()
    settings = QUICK if args.quick else LabSettings()
    capacity = (16, 64) if args.quick else (100, 1000)
    out = args.out or ("runs/knowledge_lab_quick" if args.quick else "benchmarks/results")
    if args.replot or args.markdown:
        with open(f"{out}/knowledge_lab.json") as f:
            saved = json.load(f)
        if args.markdown:
            print(markdown(saved))
        else:
            plot_all(saved, f"{out}/knowledge_lab")
        return
    require_matplotlib()
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
