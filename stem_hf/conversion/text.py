"""The text a conversion reads, cut into token id chunks: calibration (tables, refit), healing (the calibration text
that follows the calibration tokens) and held-out (the report's perplexities)."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Chunks", "ConversionText", "calibration_and_healing_chunks", "chunk_texts", "prefix_ids"]


@dataclass
class ConversionText:
    """`calibration` and `heldout` hold texts (strings, tokenized with the source's tokenizer) or token id sequences;
    keep them disjoint. `calibration_tokens` and `heldout_tokens` cap how much of each is used (None: all of it), in
    chunks of `chunk_len` tokens. Healing reads the calibration text that follows the `calibration_tokens`
    (`calibration_and_healing_chunks`; the calibration tokens again only if the text runs out). `calibration_name` and
    `heldout_name` say what the texts are, for the report and the model card."""

    calibration: Sequence = ()
    calibration_tokens: int | None = None
    heldout: Sequence = ()
    heldout_tokens: int | None = None
    chunk_len: int = 512
    calibration_name: str | None = None
    heldout_name: str | None = None

    def __post_init__(self) -> None:
        for name, cap in (("calibration_tokens", self.calibration_tokens), ("heldout_tokens", self.heldout_tokens)):
            if cap is not None and cap < 1:
                raise ValueError(f"{name}: {cap} must be at least 1 (or None: all the text)")

    def describe(self) -> tuple[str | None, str | None]:
        """What the calibration and held-out texts are, as the report names them."""
        return tuple(
            name or (f"{len(texts)} texts passed to convert()" if texts else None)
            for name, texts in ((self.calibration_name, self.calibration), (self.heldout_name, self.heldout))
        )


@dataclass
class Chunks:
    """1-D token id tensors, each starting with BOS when the source has one."""

    calibration: list[torch.Tensor]
    healing: list[torch.Tensor]
    heldout: list[torch.Tensor]

    @classmethod
    def cut(cls, text: ConversionText, tokenizer: object, bos_token_id: int | None, heal_tokens: int) -> "Chunks":
        calibration, healing = calibration_and_healing_chunks(
            text.calibration, tokenizer, bos_token_id, text.chunk_len, text.calibration_tokens, heal_tokens
        )
        heldout = chunk_texts(text.heldout, tokenizer, bos_token_id, text.chunk_len, text.heldout_tokens)
        return cls(calibration, healing, heldout)


def chunk_texts(
    texts: Sequence, tokenizer: object, bos_token_id: int | None, chunk_len: int, max_tokens: int | None
) -> list[torch.Tensor]:
    """1-D token id chunks of at most `chunk_len`, each starting with BOS when there is one, `max_tokens` in all.
    `texts` holds strings (tokenized with `tokenizer`) or token id sequences."""
    chunks, total = [], 0
    body = chunk_len - (bos_token_id is not None)
    if body < 2:
        raise ValueError(f"chunk_len: {chunk_len} leaves no room for two tokens after BOS")
    for text in texts:
        if isinstance(text, str) and tokenizer is None:
            raise ValueError("text given as strings but the source has no tokenizer: pass `tokenizer=` or token ids")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] if isinstance(text, str) else list(text)
        for start in range(0, len(ids), body):
            piece = ids[start : start + body]
            if len(piece) < 2:
                continue
            if bos_token_id is not None:
                piece = [bos_token_id, *piece]
            if max_tokens is not None:
                piece = piece[: max_tokens - total]
            chunks.append(torch.tensor(piece))
            total += len(piece)
            if max_tokens is not None and total >= max_tokens:
                return chunks
    return chunks


def calibration_and_healing_chunks(
    texts: Sequence,
    tokenizer: object,
    bos_token_id: int | None,
    chunk_len: int,
    calibration_tokens: int | None,
    heal_tokens: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`texts` tokenized once into calibration chunks (`calibration_tokens` in all, cut as `chunk_texts` cuts them) and
    the healing text that follows them (at least `heal_tokens` where the text holds them; the rest of the chunk the
    calibration ends in is skipped). Healing reads fresh text because the tables and the refit are fit so closely to
    the calibration tokens that distilling on them again teaches the model little. The healing text is empty when
    nothing follows; `heal` then cycles what it is given."""
    budget = None if calibration_tokens is None else calibration_tokens + heal_tokens + chunk_len
    chunks = chunk_texts(texts, tokenizer, bos_token_id, chunk_len, budget)
    calibration, total = [], 0
    for chunk in chunks:
        if calibration_tokens is not None:
            if total >= calibration_tokens:
                break
            chunk = chunk[: calibration_tokens - total]
        calibration.append(chunk)
        total += len(chunk)
    return calibration, chunks[len(calibration) :]


def prefix_ids(context: str, tokenizer: object, bos_token_id: int | None) -> list[int]:
    """The token ids a prior context puts before each token: BOS (when there is one), then `context`."""
    if tokenizer is None:
        raise ValueError("prior_context: a text needs the source's tokenizer (pass `tokenizer=`)")
    ids = ([] if bos_token_id is None else [bos_token_id]) + tokenizer(context, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"prior_context: {context!r} holds no token and the source has no BOS")
    return ids
