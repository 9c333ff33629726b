"""The knowledge-editing evaluation: does editing one country's lookups to another's switch the model's answer
(efficacy), and leave other countries' answers alone (locality)? Pairs written for this project."""

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from .editing import STRATEGIES, StemEdit, StemEditor, persisted

# (subject, attribute): countries and their capitals.
CAPITALS = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Japan", "Tokyo"),
    ("China", "Beijing"),
    ("Russia", "Moscow"),
    ("Egypt", "Cairo"),
    ("Greece", "Athens"),
    ("Portugal", "Lisbon"),
    ("Ireland", "Dublin"),
    ("Norway", "Oslo"),
    ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"),
    ("Poland", "Warsaw"),
    ("Austria", "Vienna"),
    ("Hungary", "Budapest"),
    ("Turkey", "Ankara"),
    ("India", "New Delhi"),
    ("Thailand", "Bangkok"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Argentina", "Buenos Aires"),
    ("Chile", "Santiago"),
    ("Cuba", "Havana"),
    ("Canada", "Ottawa"),
    ("Mexico", "Mexico City"),
    ("Australia", "Canberra"),
    ("Belgium", "Brussels"),
    ("Netherlands", "Amsterdam"),
    ("Switzerland", "Bern"),
    ("Iran", "Tehran"),
    ("Indonesia", "Jakarta"),
]
PROMPT = "The capital of {subject} is"


def _answer(model, tokenizer, prompt: str, new_tokens: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def _logprob(model, tokenizer, prompt: str, continuation: str) -> float:
    """log P(continuation | prompt), summed over the continuation's tokens (encoded apart, so the prompt's tokens, where
    an edit applies, are those of the prompt alone)."""
    prompt_ids = tokenizer(prompt)["input_ids"]
    cont = tokenizer(continuation, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids + cont], device=model.device)
    logprobs = model(ids).logits[0, len(prompt_ids) - 1 : -1].float().log_softmax(-1)
    return logprobs.gather(1, torch.tensor(cont, device=model.device)[:, None]).sum().item()


def named(answer: str, attributes: list[str]) -> str | None:
    """The attribute among `attributes` that `answer` names first, as whole words ("the city of Athens." names Athens),
    or None."""
    found = [
        (m.start(), a) for a in attributes for m in [re.search(rf"\b{re.escape(a.lower())}\b", answer.lower())] if m
    ]
    return min(found)[1] if found else None


@torch.no_grad()
def next_token_logprobs(model, prompts: list[Sequence[int]], batch_size: int = 512) -> torch.Tensor:
    """`[len(prompts), vocab]` log-probabilities of the token after each prompt (token ids). Prompts are right-padded:
    causal attention keeps the padding out of each prompt's last position."""
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        lengths = torch.tensor([len(p) for p in chunk])
        ids = torch.zeros(len(chunk), int(lengths.max()), dtype=torch.long)
        for row, p in enumerate(chunk):
            ids[row, : len(p)] = torch.tensor(p)
        logits = model(ids.to(model.device), logits_to_keep=0).logits
        out.append(logits[torch.arange(len(chunk)), lengths.to(logits.device) - 1].float().log_softmax(-1).cpu())
    return torch.cat(out) if out else torch.zeros(0, model.config.vocab_size)


def _prompt_logprobs(model, tokenizer, prompt: str) -> torch.Tensor:
    return next_token_logprobs(model, [tokenizer(prompt)["input_ids"]])[0]


def divergence_closed(edited: torch.Tensor, unedited: torch.Tensor, target: torch.Tensor) -> float | torch.Tensor:
    """1 - KL(edited || target) / KL(unedited || target), from next-token log-probabilities (the last dimension): the
    share of the gap between the source prompt's distribution and the target prompt's that an edit closes (1: the
    edited model answers the source prompt as it answers the target's; 0: unchanged; below 0: further away). Needs no
    known facts. A float for one distribution, a tensor for a batch."""
    kl = lambda p, q: (p.exp() * (p - q)).sum(-1)  # noqa: E731
    closed = 1.0 - kl(edited, target) / kl(unedited, target)
    return closed.item() if closed.ndim == 0 else closed


@dataclass(frozen=True)
class _Baseline:
    """The unedited model on every pair's prompt: its answer, whether it names the pair's attribute, its next-token
    log-probabilities."""

    answers: dict[str, str]
    known: dict[str, bool]
    logprobs: dict[str, torch.Tensor]


def _baseline(model, tokenizer, pairs: list[tuple[str, str]], new_tokens: int) -> _Baseline:
    answers = {
        s: _answer(model, tokenizer, PROMPT.format(subject=s), new_tokens) for s, _ in tqdm(pairs, desc="baseline")
    }
    attributes = [a for _, a in pairs]
    known = {s: named(answers[s], attributes) == a for s, a in pairs}
    logprobs = {s: _prompt_logprobs(model, tokenizer, PROMPT.format(subject=s)) for s, _ in pairs}
    return _Baseline(answers, known, logprobs)


def _logprob_gap(model, tokenizer, prompt: str, preferred: str, other: str) -> float:
    """log P(" preferred" | prompt) - log P(" other" | prompt)."""
    return _logprob(model, tokenizer, prompt, " " + preferred) - _logprob(model, tokenizer, prompt, " " + other)


def _kept_under_persisted(model, tokenizer, edit: StemEdit, others: list[str], base: _Baseline, new_tokens: int) -> int:
    """How many of the prompts about `others` keep their answer with `edit` persisted (the source tokens' rows
    rewritten for every context)."""
    kept = 0
    with persisted(model, edit):
        for other in others:
            kept += _answer(model, tokenizer, PROMPT.format(subject=other), new_tokens) == base.answers[other]
    return kept


def _one_edit(
    model,
    tokenizer,
    pairs: list[tuple[str, str]],
    i: int,
    strategy: str,
    base: _Baseline,
    locality_prompts: int,
    new_tokens: int,
) -> dict:
    """Pair i's subject edited to the next pair's: the answer, log-probability gaps and divergence closed under the
    per-call edit, and the locality of the persisted one."""
    subject, attribute = pairs[i]
    target, target_attribute = pairs[(i + 1) % len(pairs)]
    edit = StemEdit.from_text(tokenizer, " " + subject, " " + target, strategy)
    prompt = PROMPT.format(subject=subject)
    gap_before = _logprob_gap(model, tokenizer, prompt, target_attribute, attribute)
    with StemEditor(model, [edit]):
        answer = _answer(model, tokenizer, prompt, new_tokens)
        closed = divergence_closed(
            _prompt_logprobs(model, tokenizer, prompt), base.logprobs[subject], base.logprobs[target]
        )
        gap_after = _logprob_gap(model, tokenizer, prompt, target_attribute, attribute)
    others = [pairs[(i + k) % len(pairs)][0] for k in range(2, 2 + locality_prompts)]
    kept = _kept_under_persisted(model, tokenizer, edit, others, base, new_tokens)
    example = {"prompt": prompt, "edit": f"{subject} -> {target}", "before": base.answers[subject], "after": answer}
    return {
        "success": named(answer, [a for _, a in pairs]) == target_attribute,
        "target_known": base.known[target],
        "closed": closed,
        "gap_before": gap_before,
        "gap_after": gap_after,
        "kept": kept,
        "asked": len(others),
        "example": example,
    }


def _strategy_scores(edits: list[dict]) -> dict:
    """The scores of one strategy over its edits (one per pair)."""
    n = len(edits)
    known = [e for e in edits if e["target_known"]]
    shifts = [e["gap_after"] - e["gap_before"] for e in edits]
    kept_total = sum(e["asked"] for e in edits)
    return {
        "divergence_closed": sum(e["closed"] for e in edits) / n,
        "efficacy_score": sum(e["gap_after"] > 0 for e in edits) / n,
        "efficacy_score_before_edit": sum(e["gap_before"] > 0 for e in edits) / n,
        "mean_logprob_gap_shift": sum(shifts) / len(shifts),
        "efficacy": sum(e["success"] for e in edits) / n,
        "efficacy_where_target_known": sum(e["success"] for e in known) / len(known) if known else None,
        "edits_with_known_target": len(known),
        "locality_persisted": sum(e["kept"] for e in edits) / kept_total if kept_total else None,
        "examples": [e["example"] for e in edits[:5]],
    }


@torch.no_grad()
def evaluate_edits(
    model,
    tokenizer,
    pairs: list[tuple[str, str]] = CAPITALS,
    strategies: tuple[str, ...] = STRATEGIES,
    locality_prompts: int = 3,
    new_tokens: int = 5,
) -> dict:
    """For each pair i, edits " subject_i" -> " subject_{i+1}" (the next pair, cyclically) in the prompt about
    subject_i, with each strategy.

    - divergence closed: the mean over edits of `divergence_closed`, the edited source prompt's next-token distribution
      against the unedited target prompt's (model-agnostic: it needs no fact the model knows);
    - efficacy: the share of edits after which the answer names attribute_{i+1} first (`named`: whole words anywhere);
    - efficacy where known: the same, over edits whose target the unedited model answers right;
    - efficacy score: the share of edits after which the model gives the target's attribute a higher probability than
      the subject's own (CounterFact's measure; it reads the model's preference even where its greedy answer names
      neither), next to the same share before the edit, and the mean shift of that log-probability gap;
    - locality: the share of `locality_prompts` other pairs' prompts (the edit active, its source absent) whose answer
      stays what it was. A per-call edit leaves a prompt without its source unchanged by construction, so locality is
      measured on the persisted edit, which rewrites the source tokens' rows for every context: other prompts change
      only through tokens they share with the source.
    """
    base = _baseline(model, tokenizer, pairs, new_tokens)
    result = {
        "pairs": len(pairs),
        "baseline_accuracy": sum(base.known.values()) / len(pairs),
        "baseline_answers": base.answers,
        "strategies": {},
    }
    for strategy in strategies:
        edits = [
            _one_edit(model, tokenizer, pairs, i, strategy, base, locality_prompts, new_tokens)
            for i, _ in enumerate(tqdm(pairs, desc=f"edits ({strategy})"))
        ]
        result["strategies"][strategy] = _strategy_scores(edits)
    return result


__all__ = ["CAPITALS", "PROMPT", "divergence_closed", "evaluate_edits", "named", "next_token_logprobs"]
