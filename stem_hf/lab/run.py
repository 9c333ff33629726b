"""The lab's full run: one world, the models trained on it, every measure, the capacity curve over several world sizes,
and the editable model saved as an ordinary checkpoint with its tokenizer and fact table."""

import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from .corpus import build_tokenizer, make_world
from .measure import edit_pairs, evaluate_edits, known_people, localization, recall, spread
from .train import Blocks, LabSettings, check_regime, lab_configs, train_lab_model


def general_text() -> list[str]:
    """General text from the bundled registry corpus (calibration split), so the models also learn language."""
    from stem_hf.assets import corpora

    return corpora()["calibration"]


def prepare(settings: LabSettings, texts: list[str]):
    world = make_world(settings.people, seed=settings.seed)
    tokenizer = build_tokenizer(world, texts, settings.general_words)
    return world, tokenizer, Blocks(world, tokenizer, texts, settings)


def measure(model, world, tokenizer, pairs: int, seed: int) -> dict:
    """Recall; edits of people (`pairs` pairs of unequal name lengths under each strategy, and as many of equal
    lengths, where the strategies coincide) and of countries (every ordered pair); localization."""
    result = {"recall": recall(model, world, tokenizer)}
    known = known_people(result["recall"])
    people = edit_pairs(world, tokenizer, known, pairs, seed)
    result["known_people"] = len(known)
    result["edits"] = evaluate_edits(model, world, tokenizer, people, seed=seed)
    same = edit_pairs(world, tokenizer, known, pairs, seed, same_length=True)
    result["edits_same_length"] = evaluate_edits(model, world, tokenizer, same, strategies=("clone",), seed=seed)
    countries = [(a, b) for a in range(len(world.countries)) for b in range(len(world.countries)) if a != b]
    result["country_edits"] = evaluate_edits(model, world, tokenizer, countries, "country", strategies=("clone",))
    result["localization"] = localization(model, world, tokenizer, known)
    per_person = result["recall"]["person_train"].pop("per_person")
    result["recall"]["person_train"]["known_share"] = sum(r >= 0.8 for r in per_person) / len(per_person)
    return result


def pick_regime(runs: dict) -> str:
    """The run whose facts move with its table rows: the highest efficacy of a row swap between names of equal length,
    among runs whose trained-template recall is at least half the best recall (`tables/pad`: results saved before
    `pad` was renamed `clone`)."""

    def efficacy(run: dict) -> float:
        methods = run["edits_same_length"]["methods"]
        return methods.get("tables/clone", methods.get("tables/pad"))["efficacy"] or 0.0

    best_recall = max(r["recall"]["person_train"]["recall"] for r in runs.values())
    eligible = {k: r for k, r in runs.items() if r["recall"]["person_train"]["recall"] >= best_recall / 2}
    return max(eligible, key=lambda k: efficacy(eligible[k]))


def check_lab_args(regimes, models, capacity_people, pairs: int) -> None:
    """Raises on what would otherwise fail (or go wrong quietly) after the first model has trained."""
    for regime in regimes:
        check_regime(regime, stem=True)
    unknown = [m for m in models if m not in ("dense", "STEM-1/2", "STEM-full")]
    if unknown:
        raise ValueError(f"lab: unknown model {unknown[0]!r}: dense, STEM-1/2 or STEM-full")
    if any(n < 2 for n in capacity_people):
        raise ValueError(f"lab: every capacity world needs at least 2 people, got {list(capacity_people)}")
    if pairs < 1:
        raise ValueError(f"lab: pairs must be at least 1, got {pairs}")


def run_lab(
    settings: LabSettings,
    out: str | os.PathLike,
    texts: list[str],
    regimes: tuple[str, ...] = ("plain",),
    models: tuple[str, ...] = ("dense", "STEM-1/2", "STEM-full"),
    capacity_people: tuple[int, ...] = (),
    pairs: int = 200,
    save_editable: bool = True,
) -> dict:
    """Trains `models` (plain) and STEM-full under each regime of `regimes` on one world of `settings.people`,
    measures each, then trains `models` plain on worlds of `capacity_people` people for the capacity curve. Saves the
    STEM-full model of the best regime (`pick_regime`) to `out/editable` with its tokenizer and `facts.json`."""
    check_lab_args(regimes, models, capacity_people, pairs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    world, tokenizer, data = prepare(settings, texts)
    world.save(out)
    configs = lab_configs(settings, len(tokenizer))
    jobs = list(dict.fromkeys([(name, "plain") for name in models] + [("STEM-full", r) for r in regimes]))
    runs, trained = {}, {}
    for name, regime in jobs:
        key = name if regime == "plain" else f"{name} {regime}"
        model, info = train_lab_model(configs[name], regime, data, world, tokenizer, settings, out / "trainer")
        runs[key] = {**info, **measure(model, world, tokenizer, pairs, settings.seed)}
        trained[key] = model
        print(f"{key}: recall {runs[key]['recall']['person_train']['recall']:.3f}", flush=True)
    stem_runs = {k: r for k, r in runs.items() if r["stem_layers"] and k.startswith("STEM-full")}
    best = pick_regime(stem_runs) if stem_runs else None
    result = {
        "settings": asdict(settings),
        "world": {"people": len(world.people), "countries": len(world.countries), "vocab_size": len(tokenizer)},
        "runs": runs,
        "best_for_editing": best,
    }
    if "dense" in trained and best:
        ids = torch.cat([data.data[i] for i in range(min(len(data), 64))])
        shown = [k for k in dict.fromkeys(["STEM-full", best]) if k in trained]
        result["angular_spread"] = {k: spread(trained[k], trained["dense"], ids) for k in shown}
    if best and save_editable:
        folder = out / "editable"
        trained[best].save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        world.save(folder)
        result["editable_checkpoint"] = str(folder)
    result["capacity"] = capacity(settings, texts, models, capacity_people, runs, out / "trainer")
    result["wall_seconds"] = time.perf_counter() - start
    return result


def capacity(settings: LabSettings, texts: list[str], models, people: tuple[int, ...], runs: dict, out: Path) -> dict:
    """Recall and stored bits of each plain model against the number of people, at fixed model size and training
    tokens; per active and per total parameter. The main world's runs are reused."""
    curve = {name: [] for name in models}
    for n in sorted(set(people) | {settings.people}):
        if n == settings.people:
            results = {name: runs[name] for name in models}
        else:
            s = replace(settings, people=n)
            world, tokenizer, data = prepare(s, texts)
            configs = lab_configs(s, len(tokenizer))
            results = {}
            for name in models:
                model, info = train_lab_model(configs[name], "plain", data, world, tokenizer, s, out)
                results[name] = {**info, "recall": recall(model, world, tokenizer)}
                results[name]["recall"]["person_train"].pop("per_person")
        for name, r in results.items():
            bits = r["recall"]["stored_bits"]
            curve[name].append({
                "people": n,
                "recall": r["recall"]["person_train"]["recall"],
                "stored_bits": bits,
                "max_bits": r["recall"]["max_bits"],
                "bits_per_active_param": bits / r["active_params_per_token"],
                "bits_per_total_param": bits / r["total_params"],
            })  # fmt: skip
    return curve


def write_json(result: dict, path: str | os.PathLike) -> None:
    """Atomically: a killed run leaves the previous file or none, never half of one."""
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)


__all__ = ["capacity", "check_lab_args", "general_text", "measure", "pick_regime", "prepare", "run_lab", "write_json"]
