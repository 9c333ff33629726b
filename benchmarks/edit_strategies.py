"""Edit strategies for names of unequal length, and knowledge injection, on one knowledge-lab model: STEM-full trained
in the regime the lab found best for editing (`DEFAULT_REGIME`, benchmarks/results/knowledge_lab.json).

Edits: efficacy, generalization, divergence closed and locality of each strategy (clone, filler, subset, mean) with
the target shorter than the source and with it longer, beside names of equal length (where the strategies coincide)
and the text baseline. Injection: for known people, a new value of one attribute (one the world does not hold for
them) trained into the rows of a name word (`stem_hf.injection`), measured, then undone.

    .venv/bin/python benchmarks/edit_strategies.py          # JSON in benchmarks/results/edit_strategies.json
    .venv/bin/python benchmarks/edit_strategies.py --quick  # the test size (results in runs/edit_strategies_quick)
    .venv/bin/python benchmarks/edit_strategies.py --markdown  # the tables of docs/knowledge_lab.md, from the JSON
"""

import argparse
import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from stem_hf.editing import STRATEGIES
from stem_hf.injection import injected
from stem_hf.lab.measure import edit_pairs, evaluate_edits, known_people, predict, probes, recall
from stem_hf.lab.run import general_text, prepare, write_json
from stem_hf.lab.train import DEFAULT_REGIME, QUICK, LabSettings, lab_configs, train_lab_model

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--quick", action="store_true", help="24 people, 600 steps: tests the pipeline")
parser.add_argument("--pairs", type=int, default=300, help="edit pairs of unequal name lengths (and as many equal)")
parser.add_argument("--inject-people", type=int, default=40, help="people who each get one injected fact")
parser.add_argument("--inject-steps", type=int, default=100, help="steps of an injection from the fact alone")
parser.add_argument("--rehearsal-steps", type=int, default=300, help="steps of an injection with rehearsal")
parser.add_argument("--inject-lr", type=float, default=3e-3)
parser.add_argument("--markdown", action="store_true", help="print the docs' tables from the saved JSON")
parser.add_argument("--out", default=None, help="default: benchmarks/results (runs/edit_strategies_quick, --quick)")
args = parser.parse_args()
EDIT_KEYS = ("efficacy", "generalization", "divergence_closed", "locality", "locality_shared_name_token")
INJECTION_KEYS = ("recall_train", "recall_heldout", "before_train", "own_kept", "others_kept", "sharers_kept")


def f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def markdown(result: dict) -> str:
    """The tables docs/knowledge_lab.md quotes (tests/test_doc_figures.py rebuilds them from the JSON)."""
    lines = ["| pairs | edit | efficacy | generalization | divergence closed | locality | locality, shared name word |",
             "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for group, e in result["edits"].items():
        for method, m in e["methods"].items():
            cells = [f"{group.replace('_', ' ')} ({e['pairs']})", method, *(f(m[k]) for k in EDIT_KEYS)]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| texts | name | people | recall, trained templates | held-out templates | before | "
              "own other facts kept | others' facts kept | sharers of the word kept |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for key, r in result["injection"].items():
        texts, name = key.replace("_", " ").split("/")
        cells = [texts, name, str(r["people"]), *(f(r[k]) for k in INJECTION_KEYS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if args.markdown:
    print(markdown(json.loads(Path(args.out or "benchmarks/results", "edit_strategies.json").read_text())))
    sys.exit()
settings = QUICK if args.quick else LabSettings()
seed = settings.seed
out = Path(args.out or ("runs/edit_strategies_quick" if args.quick else "benchmarks/results"))
start = time.perf_counter()

# One model: STEM-full in the regime that puts the facts in the rows.
world, tokenizer, data = prepare(settings, general_text())
config = lab_configs(settings, len(tokenizer))["STEM-full"]
model, info = train_lab_model(config, DEFAULT_REGIME, data, world, tokenizer, settings, "runs/edit_strategies/trainer")
remembered = recall(model, world, tokenizer)
known = known_people(remembered)
print(f"trained in {info['train_seconds']:.0f} s; recall {remembered['person_train']['recall']:.3f}", flush=True)

# Edits: pairs of unequal name lengths split by which side is longer, and pairs of equal lengths.
length = {i: len(tokenizer(world.people[i]["name"], add_special_tokens=False).input_ids) for i in known}
unequal = edit_pairs(world, tokenizer, known, args.pairs, seed)
groups = {
    "equal_length": (edit_pairs(world, tokenizer, known, args.pairs, seed, same_length=True), ("clone",)),
    "target_shorter": ([(a, b) for a, b in unequal if length[b] < length[a]], STRATEGIES),
    "target_longer": ([(a, b) for a, b in unequal if length[b] > length[a]], STRATEGIES),
}
edits = {}
for group, (pairs, strategies) in groups.items():
    edits[group] = evaluate_edits(model, world, tokenizer, pairs, methods=("tables", "text"), strategies=strategies)
    print(f"{group}: {len(pairs)} pairs", flush=True)


# Injection: the k-th chosen person gets a new value of attribute k mod 6, one the world holds for someone else but
# never for them, trained into the rows of the last word of their name: from the fact's four trained-template sentences
# alone, and with rehearsal (the person's other facts, as the model states them, in the same templates; the fact's
# sentences repeated as often as there are other attributes, so that both weigh the same).
def answers(questions) -> torch.Tensor:
    return predict(model, [q.prompt for q in questions]) if questions else torch.zeros(0, dtype=torch.long)


def injection_case(person: int, attribute: str, rng: random.Random) -> dict:
    """The fact, the sentences that teach it, the prompts measured, and the unedited model's answers to them."""
    entry, templates = world.people[person], world.person_templates
    name, word = entry["name"], entry["name"].split()[-1]
    new = rng.choice(sorted({p[attribute] for p in world.people} - {entry[attribute]}))  # an answer it can give
    asked = {split: probes(world, tokenizer, "person", split, [person]) for split in ("train", "heldout")}
    own = [q for q in asked["train"] if q.attribute != attribute]
    first = [q for q in own if q.template == 0]
    said = tokenizer.convert_ids_to_tokens(answers(first).tolist())
    stated = {q.attribute: value for q, value in zip(first, said, strict=True)}  # what the model says of them now
    sharers = [i for i, p in enumerate(world.people) if i != person and word in p["name"].split()]
    others = [i for i in range(len(world.people)) if i != person and i not in sharers]
    pool = probes(world, tokenizer, "person", "train", rng.sample(others, min(24, len(others))))
    pool = [q for q in pool + probes(world, tokenizer, "country", "train") if q.template == 0]
    prompts = {
        "own": own,
        "pool": pool,
        "shared": probes(world, tokenizer, "person", "train", sharers) if sharers else [],
        **{split: [q for q in qs if q.attribute == attribute] for split, qs in asked.items()},
    }
    fact = [t.format(name=name, v=new) for t in templates[attribute][0]]
    rehearsal = [t.format(name=name, v=v) for a, v in stated.items() for t in templates[a][0]]
    return {
        "person": person, "words": len(name.split()), "attribute": attribute, "new_value": new,
        "token": tokenizer.convert_tokens_to_ids(word), "new_id": tokenizer.convert_tokens_to_ids(new),
        "prompts": prompts, "before": {k: answers(v) for k, v in prompts.items()},
        "texts": {"fact_only": fact, "with_rehearsal": fact * len(stated) + rehearsal},
    }  # fmt: skip


def inject(case: dict, variant: str, steps: int) -> dict:
    """One injection, measured, then undone."""
    before, prompts = case["before"], case["prompts"]
    with injected(model, tokenizer, case["texts"][variant], case["token"], steps=steps, lr=args.inject_lr) as done:
        after = {k: answers(prompts[k]) for k in ("own", "pool", "shared", "train", "heldout")}
    return {
        "recall_train": (after["train"] == case["new_id"]).float().tolist(),
        "recall_heldout": (after["heldout"] == case["new_id"]).float().tolist(),
        "before_train": (before["train"] == case["new_id"]).float().tolist(),
        "own_kept": (after["own"] == before["own"]).float().tolist(),
        "others_kept": (after["pool"] == before["pool"]).float().tolist(),
        "sharers_kept": (after["shared"] == before["shared"]).float().tolist(),
        "loss": [done.losses[0], done.losses[-1]],  # on the texts, before and after
    }


def mean(rows: list[dict], key: str) -> float | None:
    values = [v for r in rows for v in r[key]]
    return sum(values) / len(values) if values else None


rng = random.Random(seed)
chosen = rng.sample(known, min(args.inject_people, len(known)))
cases = [injection_case(p, world.person_attributes[k % 6], rng) for k, p in enumerate(chosen)]
steps = {"fact_only": args.inject_steps, "with_rehearsal": args.rehearsal_steps}
injections = [{**{k: c[k] for k in ("person", "words", "attribute", "new_value")},
               **{v: inject(c, v, steps[v]) for v in steps}} for c in cases]  # fmt: skip
injection = {}
for variant in steps:
    for name, rows in (("one_word", [r[variant] for r in injections if r["words"] == 1]),
                       ("several_words", [r[variant] for r in injections if r["words"] > 1])):  # fmt: skip
        injection[f"{variant}/{name}"] = {"people": len(rows), **{k: mean(rows, k) for k in INJECTION_KEYS}}

result = {
    "command": "python " + " ".join(sys.argv),
    "settings": {**asdict(settings), "regime": DEFAULT_REGIME, "pairs": args.pairs,
                 "inject_people": args.inject_people, "inject_steps": args.inject_steps,
                 "rehearsal_steps": args.rehearsal_steps, "inject_lr": args.inject_lr},
    "seeds": {"world_and_training": seed, "pairs": seed, "injection": seed},
    "world": {"people": len(world.people), "vocab_size": len(tokenizer)},
    "train_seconds": info["train_seconds"],
    "recall": {k: remembered[k]["recall"] for k in ("person_train", "person_heldout")},
    "known_people": len(known),
    "edits": edits,
    "injection": injection,
    "injections": injections,
    "wall_seconds": time.perf_counter() - start,
}  # fmt: skip
out.mkdir(parents=True, exist_ok=True)
write_json(result, out / "edit_strategies.json")


print(markdown(result))
print(f"\nwall {result['wall_seconds']:.0f} s")
