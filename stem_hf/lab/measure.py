"""What the lab measures on a trained model: recall of each fact by greedy decoding on trained and held-out templates,
stored bits, edits by rows with their baselines (efficacy, generalization, locality), where the identity of an entity
lives (knock-outs per layer), and the angular spread of table rows against dense up-projection outputs.

Every value is one token, so greedy decoding of an answer is the argmax after its prompt. Prompts start with `<s>`, as
every training document does.
"""

import math
import random
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from ..analysis import dense_up_spread, table_spread
from ..edit_eval import divergence_closed, next_token_logprobs
from ..editing import RENAMED_STRATEGIES, STRATEGIES, StemEdit, filler_id, persisted, write_edited_rows
from .corpus import LabWorld


@dataclass(frozen=True)
class Probe:
    """One question: the prompt about `subject` (an index into people or countries) and the id of its answer."""

    kind: str  # "person" or "country"
    subject: int
    attribute: str
    split: str  # "train" or "heldout" templates
    template: int
    prompt: tuple[int, ...]
    answer: int


def probes(world: LabWorld, tokenizer, kind: str, split: str = "train", subjects=None, name_of=None) -> list[Probe]:
    """Every prompt of `split` templates about the `subjects` (default: all) of `kind`; `name_of(i)` may write a
    subject under another name (the text-substitution baseline) while the answer stays the subject's own."""
    entries = world.people if kind == "person" else world.countries
    templates = world.person_templates if kind == "person" else world.country_templates
    subjects = range(len(entries)) if subjects is None else subjects
    rows = []
    for i in subjects:
        name = entries[i]["name"] if name_of is None else name_of(i)
        for attribute, (trained, heldout) in templates.items():
            for t, template in enumerate(trained if split == "train" else heldout):
                rows.append(
                    (i, attribute, t, template.split("{v}")[0].format(name=name).strip(), entries[i][attribute])
                )
    prompts = tokenizer([r[3] for r in rows])["input_ids"]
    answers = tokenizer.convert_tokens_to_ids([r[4] for r in rows])
    return [
        Probe(kind, i, attribute, split, t, tuple(p), a)
        for (i, attribute, t, _, _), p, a in zip(rows, prompts, answers, strict=True)
    ]


def predict(model: nn.Module, prompts: list[tuple[int, ...]]) -> torch.Tensor:
    """The greedy next token after each prompt."""
    return next_token_logprobs(model, prompts).argmax(-1)


def accuracy(model: nn.Module, questions: list[Probe]) -> torch.Tensor:
    """1.0 where the model answers a probe right, else 0.0."""
    answers = torch.tensor([q.answer for q in questions])
    return (predict(model, [q.prompt for q in questions]) == answers).float()


def _mean_by(values: torch.Tensor, keys: list) -> dict:
    """The mean of `values` per key, keys in order of first appearance."""
    return {k: values[[i for i, key in enumerate(keys) if key == k]].mean().item() for k in dict.fromkeys(keys)}


def recall(model: nn.Module, world: LabWorld, tokenizer) -> dict:
    """Exact-match recall per attribute on trained and on held-out templates, for people (also by name length in
    tokens) and countries; and the bits stored: log2 of each attribute's value count times its recall, over people."""
    result = {}
    for kind in ("person", "country"):
        for split in ("train", "heldout"):
            questions = probes(world, tokenizer, kind, split)
            hits = accuracy(model, questions)
            entry = {"recall": hits.mean().item(), "by_attribute": _mean_by(hits, [q.attribute for q in questions])}
            if kind == "person":
                lengths = [str(len(world.people[q.subject]["name"].split())) for q in questions]
                entry["by_name_tokens"] = _mean_by(hits, lengths)
                if split == "train":
                    entry["per_person"] = list(_mean_by(hits, [q.subject for q in questions]).values())
            result[f"{kind}_{split}"] = entry
    bits = sum(math.log2(len(set(world.values[a]))) * r for a, r in result["person_train"]["by_attribute"].items())
    result["stored_bits"] = bits * len(world.people)
    result["max_bits"] = sum(math.log2(len(set(world.values[a]))) for a in world.person_attributes) * len(world.people)
    return result


METHODS = ("tables", "embedding", "both", "text")


@contextmanager
def _input_embedding_copy(model: nn.Module) -> Iterator[torch.Tensor]:
    """The model reads a copy of its input embedding, whose weight the block may change, until the block ends; a tied
    output head keeps the original rows."""
    embed = model.get_input_embeddings()
    copy = nn.Embedding.from_pretrained(embed.weight.detach().clone(), freeze=True, padding_idx=embed.padding_idx)
    model.set_input_embeddings(copy)
    try:
        yield copy.weight
    finally:
        model.set_input_embeddings(embed)


@contextmanager
def swapped_rows(model: nn.Module, edit: StemEdit, where: str) -> Iterator[None]:
    """The model with `edit` written into its table rows (`tables`, the paper's edit, persisted in every context), its
    input-embedding rows (`embedding`, the baseline), or `both`; exactly as it was on exit."""
    if where not in METHODS[:3]:
        raise ValueError(f"swapped_rows: where must be one of {', '.join(METHODS[:3])}, got {where!r}")
    with ExitStack() as stack:
        if where in ("tables", "both"):
            stack.enter_context(persisted(model, edit))
        if where in ("embedding", "both"):
            write_edited_rows(stack.enter_context(_input_embedding_copy(model)), edit)
        yield


def _name_ids(tokenizer, name: str) -> tuple[int, ...]:
    return tuple(tokenizer(name, add_special_tokens=False)["input_ids"])


def known_people(result: dict, threshold: float = 0.8) -> list[int]:
    """People whose trained-template recall is at least `threshold` (the unedited model knows their facts)."""
    return [i for i, r in enumerate(result["person_train"]["per_person"]) if r >= threshold]


def edit_pairs(world: LabWorld, tokenizer, known: list[int], n: int, seed: int, same_length: bool = False) -> list:
    """Up to `n` random (A, B) pairs among `known` people, A != B, whose names differ in token length (where the
    strategies differ), or with `same_length`, whose names have the same length."""
    rng = random.Random(seed)
    lengths = {i: len(_name_ids(tokenizer, world.people[i]["name"])) for i in known}
    candidates = [(a, b) for a in known for b in known if a != b and (lengths[a] == lengths[b]) == same_length]
    rng.shuffle(candidates)
    return candidates[:n]


def _share(counts: dict, key: str) -> float | None:
    return counts[key] / counts[key + "_n"] if counts[key + "_n"] else None


def _methods_to_run(
    model: nn.Module, kind: str, methods: tuple[str, ...] | None, strategies: tuple[str, ...]
) -> tuple[str, ...]:
    """`methods` (default: every one that applies to the model), once `kind`, methods and strategies are checked."""
    stem = bool(model.config.stem_layers)
    methods = methods or (METHODS if stem else ("embedding", "text"))
    if kind not in ("person", "country"):
        raise ValueError(f"evaluate_edits: kind must be 'person' or 'country', got {kind!r}")
    unknown = [m for m in methods if m not in METHODS or (m in ("tables", "both") and not stem)]
    if unknown or any(s not in STRATEGIES and s not in RENAMED_STRATEGIES for s in strategies):
        raise ValueError(f"evaluate_edits: methods {methods} / strategies {strategies}: not all apply to this model")
    return methods


def _locality_pool(model: nn.Module, world: LabWorld, tokenizer) -> tuple[list[Probe], torch.Tensor]:
    """Every subject's first trained template (people, then countries) and the unedited model's answers to them."""
    pool = probes(world, tokenizer, "person", "train") + probes(world, tokenizer, "country", "train")
    pool = [q for q in pool if q.template == 0]
    return pool, predict(model, [q.prompt for q in pool])


def _name_tokens(world: LabWorld, tokenizer) -> dict[tuple[str, int], set[int]]:
    """The token ids of each person's and each country's name, by (kind, index)."""
    names = {("person", i): set(_name_ids(tokenizer, p["name"])) for i, p in enumerate(world.people)}
    names |= {("country", i): set(_name_ids(tokenizer, c["name"])) for i, c in enumerate(world.countries)}
    return names


def _edited_prompts(world: LabWorld, tokenizer, kind: str, a: int, b: int) -> tuple[list[Probe], list[Probe]]:
    """A's prompts (trained and held-out templates) whose answer differs for B, and the same prompts with B's name
    written in place of A's (the `text` method)."""
    entries = world.people if kind == "person" else world.countries
    own = [q for split in ("train", "heldout") for q in probes(world, tokenizer, kind, split, [a])]
    keep = [entries[b][q.attribute] != entries[a][q.attribute] for q in own]
    as_b = lambda _, name=entries[b]["name"]: name  # noqa: E731
    text = [q for split in ("train", "heldout") for q in probes(world, tokenizer, kind, split, [a], as_b)]
    own = [q for q, k in zip(own, keep, strict=True) if k]
    text = [q for q, k in zip(text, keep, strict=True) if k]
    return own, text


def _locality_prompts(
    pool: list[Probe], names: dict, kind: str, a: int, chosen: set[int]
) -> tuple[list[int], list[int]]:
    """Indices into `pool`, none about A: every country's and the `chosen` people's prompts; and the prompts about
    people whose name shares a token with A's."""
    others = [i for i, q in enumerate(pool) if (q.kind, q.subject) != (kind, a)]
    local = [i for i in others if pool[i].kind == "country" or pool[i].subject in chosen]
    shares = [i for i in others if pool[i].kind == "person" and names[(kind, a)] & names[("person", pool[i].subject)]]
    return local, shares


def _edit_cases(
    model: nn.Module,
    world: LabWorld,
    tokenizer,
    pairs: list[tuple[int, int]],
    kind: str,
    pool: list[Probe],
    locality_people: int,
    seed: int,
) -> list[dict]:
    """Per pair, the prompts every method is measured on, with the unedited model's next-token distributions on A's
    prompts and on the same prompts with B's name."""
    entries = world.people if kind == "person" else world.countries
    rng = random.Random(seed)
    names = _name_tokens(world, tokenizer)
    filler = filler_id(tokenizer)
    cases = []
    for a, b in pairs:
        own, text = _edited_prompts(world, tokenizer, kind, a, b)
        candidates = [i for i in range(len(world.people)) if kind != "person" or i != a]
        chosen = set(rng.sample(candidates, min(locality_people, len(candidates))))
        local, shares = _locality_prompts(pool, names, kind, a, chosen)
        cases.append({
            "edit": (_name_ids(tokenizer, entries[a]["name"]), _name_ids(tokenizer, entries[b]["name"])),
            "filler": filler,
            "own": own, "text": text, "local": local, "shares": shares,
            "targets": torch.tensor(tokenizer.convert_tokens_to_ids([entries[b][q.attribute] for q in own])),
            "train": torch.tensor([q.split == "train" for q in own], dtype=torch.bool),
            "unedited": next_token_logprobs(model, [q.prompt for q in own]),
            "target": next_token_logprobs(model, [q.prompt for q in text]),
        })  # fmt: skip
    return cases


def _count_case(
    counts: dict,
    model: nn.Module,
    case: dict,
    pool: list[Probe],
    base_pool: torch.Tensor,
    method: str,
    strategy: str | None,
) -> None:
    """Adds one case's hits and prompts under `method` and `strategy` to `counts`."""
    own = case["text" if method == "text" else "own"]
    prompts = [q.prompt for q in own] + [pool[i].prompt for i in case["local"] + case["shares"]]
    if method == "text":
        logprobs = next_token_logprobs(model, prompts)
    else:
        with swapped_rows(model, StemEdit(*case["edit"], strategy, case["filler"]), method):
            logprobs = next_token_logprobs(model, prompts)
        closed = divergence_closed(logprobs[: len(own)], case["unedited"], case["target"])
        counts["div"] += closed[closed.isfinite()].sum().item()  # not where A's and B's prompts agree
        counts["div_n"] += closed.isfinite().sum().item()
    answers = logprobs.argmax(-1)
    hit, train = answers[: len(own)] == case["targets"], case["train"]
    kept = answers[len(own) :] == base_pool[case["local"] + case["shares"]]
    n_local = len(case["local"])
    for key, values in (("eff", hit[train]), ("gen", hit[~train]), ("loc", kept[:n_local]),
                        ("shared", kept[n_local:])):  # fmt: skip
        counts[key] += values.sum().item()
        counts[key + "_n"] += len(values)


def _run_result(counts: dict, method: str) -> dict:
    """The shares and prompt counts of one method under one strategy; `text` leaves the model unchanged: no
    divergence or locality."""
    return {
        "efficacy": _share(counts, "eff"),
        "generalization": _share(counts, "gen"),
        "divergence_closed": None if method == "text" else _share(counts, "div"),
        "locality": None if method == "text" else _share(counts, "loc"),
        "locality_shared_name_token": None if method == "text" else _share(counts, "shared"),
        "prompts": {
            "efficacy": counts["eff_n"],
            "generalization": counts["gen_n"],
            "locality": counts["loc_n"],
            "shared_name_token": counts["shared_n"],
        },
    }


@torch.no_grad()
def evaluate_edits(
    model: nn.Module,
    world: LabWorld,
    tokenizer,
    pairs: list[tuple[int, int]],
    kind: str = "person",
    methods: tuple[str, ...] | None = None,
    strategies: tuple[str, ...] = STRATEGIES,
    locality_people: int = 24,
    seed: int = 0,
) -> dict:
    """Edits A -> B for each pair and measures, over A's prompts whose answer differs for B:
    - efficacy: the share answered with B's value on trained templates; generalization: on held-out templates;
    - divergence closed: the mean over A's prompts of `edit_eval.divergence_closed`, the edited model's next-token
      distribution against the unedited model's on the same prompt with B's name (the model-agnostic efficacy);
    - locality: the share of other subjects' prompts (trained templates, `locality_people` random people and every
      country, none of them A) whose answer stays the unedited model's; and the same over the people among them who
      share a name token with A, where a persisted row edit can leak;
    for each method: `tables` (the paper's row swap), `embedding` (the input-embedding rows instead), `both`, and
    `text` (B's name written in place of A's: the upper bound; the model is unchanged, so it has no locality).
    Methods with rows run under each strategy; `text` once."""
    methods = _methods_to_run(model, kind, methods, strategies)
    pool, base_pool = _locality_pool(model, world, tokenizer)
    cases = _edit_cases(model, world, tokenizer, pairs, kind, pool, locality_people, seed)  # the same for every method
    results = {}
    runs = [(m, s) for m in methods if m != "text" for s in strategies] + [("text", None)] * ("text" in methods)
    for method, strategy in tqdm(runs, desc=f"{kind} edits", leave=False):
        keys = ("eff", "gen", "loc", "shared", "div")
        counts = dict.fromkeys(keys, 0) | {k + "_n": 0 for k in keys}
        for case in cases:
            _count_case(counts, model, case, pool, base_pool, method, strategy)
        results[method if strategy is None else f"{method}/{strategy}"] = _run_result(counts, method)
    return {"pairs": len(pairs), "methods": results}


@contextmanager
def knocked_out(model: nn.Module, ids: torch.Tensor, where: str | int) -> Iterator[None]:
    """The rows of `ids` replaced by their mean: in the input embedding (`embedding`, on a copy), in every table
    (`tables`), or in the table of one STEM layer (an int)."""
    if where == "embedding":
        with _input_embedding_copy(model) as weight:
            with torch.no_grad():
                weight[ids] = weight[ids].mean(dim=0)
            yield
        return
    if where != "tables" and where not in model.config.stem_layers:
        raise ValueError(f"knocked_out: where must be 'embedding', 'tables' or a STEM layer, got {where!r}")
    layers = model.config.stem_layers if where == "tables" else [where]
    weights = [model.base_model.stem_tables[str(layer)].weight for layer in layers]
    saved = [w.detach()[ids].clone() for w in weights]
    with torch.no_grad():
        for w in weights:
            w[ids] = w[ids].mean(dim=0)
    try:
        yield
    finally:
        with torch.no_grad():
            for w, rows in zip(weights, saved, strict=True):
                w[ids] = rows


@torch.no_grad()
def localization(model: nn.Module, world: LabWorld, tokenizer, people: list[int]) -> dict:
    """Recall of `people` (trained templates) when every entity token's rows are replaced by the mean entity row: in
    the input embedding, in all tables, in each STEM layer's table alone. Where recall falls is where identity lives."""
    from .train import entity_ids

    ids = entity_ids(world, tokenizer)
    questions = probes(world, tokenizer, "person", "train", people)
    result = {"people": len(people), "none": accuracy(model, questions).mean().item()}
    places = ["embedding"] + (["tables", *model.config.stem_layers] if model.config.stem_layers else [])
    for where in places:
        with knocked_out(model, ids, where):
            result[where if isinstance(where, str) else f"layer_{where}"] = accuracy(model, questions).mean().item()
    return result


@torch.no_grad()
def spread(stem: nn.Module, dense: nn.Module, stream: torch.Tensor) -> dict:
    """Angular spread (|cos| between random pairs) of the STEM model's table rows for the distinct tokens of `stream`
    against the dense model's `W_up x` over the same tokens, at the STEM layers."""
    layers = list(stem.config.stem_layers)
    length = dense.config.max_position_embeddings - 1  # positions the models were trained on, after <s>
    bos = torch.tensor([dense.config.bos_token_id])
    chunks = [torch.cat([bos, stream[s : s + length]]) for s in range(0, len(stream) - length + 1, length)]
    result = {"stem": table_spread(stem, stream), "dense": dense_up_spread(dense, chunks, layers)}
    summary = {
        name: {str(k): {"p95_abs_cos": v["p95_abs_cos"], "mean_abs_cos": v["mean_abs_cos"]} for k, v in s.items()}
        for name, s in result.items()
    }
    return {"per_layer": summary, "histograms": result}


__all__ = [
    "METHODS",
    "Probe",
    "accuracy",
    "edit_pairs",
    "evaluate_edits",
    "known_people",
    "knocked_out",
    "localization",
    "next_token_logprobs",
    "predict",
    "probes",
    "recall",
    "spread",
    "swapped_rows",
]
