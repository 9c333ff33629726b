"""The knowledge-editing evaluation: does editing one country's lookups to another's switch the model's answer
(efficacy), and leave other countries' answers alone (locality)? Pairs written for this project."""

import re
from collections.abc import Sequence

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
    base = {s: _answer(model, tokenizer, PROMPT.format(subject=s), new_tokens) for s, _ in tqdm(pairs, desc="baseline")}
    attributes = [a for _, a in pairs]
    known = {s: named(base[s], attributes) == a for s, a in pairs}
    logprobs = {s: _prompt_logprobs(model, tokenizer, PROMPT.format(subject=s)) for s, _ in pairs}
    result = {
        "pairs": len(pairs),
        "baseline_accuracy": sum(known.values()) / len(pairs),
        "baseline_answers": base,
        "strategies": {},
    }
    for strategy in strategies:
        hits, known_hits, known_total, kept, kept_total, examples = 0, 0, 0, 0, 0, []
        prefer_before = prefer_after = 0
        shifts, closed = [], []
        for i, (subject, attribute) in enumerate(tqdm(pairs, desc=f"edits ({strategy})")):
            target, target_attribute = pairs[(i + 1) % len(pairs)]
            edit = StemEdit.from_text(tokenizer, " " + subject, " " + target, strategy)
            prompt = PROMPT.format(subject=subject)
            gap_before = _logprob(model, tokenizer, prompt, " " + target_attribute) - _logprob(
                model, tokenizer, prompt, " " + attribute
            )
            with StemEditor(model, [edit]):
                answer = _answer(model, tokenizer, prompt, new_tokens)
                closed.append(divergence_closed(_prompt_logprobs(model, tokenizer, prompt), logprobs[subject],
                                                logprobs[target]))  # fmt: skip
                gap_after = _logprob(model, tokenizer, prompt, " " + target_attribute) - _logprob(
                    model, tokenizer, prompt, " " + attribute
                )
            prefer_before += gap_before > 0
            prefer_after += gap_after > 0
            shifts.append(gap_after - gap_before)
            success = named(answer, attributes) == target_attribute
            hits += success
            if known[target]:
                known_hits, known_total = known_hits + success, known_total + 1
            if len(examples) < 5:
                examples.append(
                    {
                        "prompt": PROMPT.format(subject=subject),
                        "edit": f"{subject} -> {target}",
                        "before": base[subject],
                        "after": answer,
                    }
                )
            # Locality of the persisted form: rows of the source tokens rewritten, other prompts asked.
            with persisted(model, edit):
                others = [pairs[(i + k) % len(pairs)][0] for k in range(2, 2 + locality_prompts)]
                for other in others:
                    kept += _answer(model, tokenizer, PROMPT.format(subject=other), new_tokens) == base[other]
                    kept_total += 1
        result["strategies"][strategy] = {
            "divergence_closed": sum(closed) / len(closed),
            "efficacy_score": prefer_after / len(pairs),
            "efficacy_score_before_edit": prefer_before / len(pairs),
            "mean_logprob_gap_shift": sum(shifts) / len(shifts),
            "efficacy": hits / len(pairs),
            "efficacy_where_target_known": known_hits / known_total if known_total else None,
            "edits_with_known_target": known_total,
            "locality_persisted": kept / kept_total if kept_total else None,
            "examples": examples,
        }
    return result


__all__ = ["CAPITALS", "PROMPT", "divergence_closed", "evaluate_edits", "named", "next_token_logprobs"]
