"""Option types for `stem-hf`: each refuses a bad value while the command line is parsed, so that argparse names the
option and nothing has loaded yet. Imports nothing heavy."""

import argparse
import math
import os
from collections.abc import Callable


def int_at_least(minimum: int) -> Callable[[str], int]:
    """The type of a whole-number option that must be at least `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be a whole number of at least {minimum}, not {text!r}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def positive_ints(text: str) -> list[int]:
    """The type of an option that lists whole numbers of at least 1, comma-separated (`1,16,64`)."""
    try:
        return [positive_int(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        message = f"must be whole numbers of at least 1, comma-separated, not {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0 (a learning rate)."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number of at least 0."""
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {text!r}")
    return value


def share(text: str) -> float:
    """A share of something, in [0, 1]."""
    value = _finite(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a share in [0, 1], not {text!r}")
    return value


def eval_limit(text: str) -> int | float:
    """lm-eval's `limit`: a whole number of examples per task, or a fraction of them below 1."""
    value = positive_float(text)
    if value < 1:
        return value
    if not value.is_integer():
        raise argparse.ArgumentTypeError(
            f"must be a whole number of examples per task, or a fraction of them below 1, not {text!r}"
        )
    return int(value)


def utf8_text(text: str) -> str:
    """Free text the model reads or a card shows. Bytes that are not UTF-8 reach Python as surrogate escapes
    ('\\udcff'), which no tokenizer or UTF-8 file takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"{_as_bytes(text)!r} is not valid UTF-8; pass the text in UTF-8") from None
    return text


def _as_bytes(text: str) -> bytes:
    """The bytes `text` came from, where it came from bytes; else its escapes spelled out."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace")


def file_path(text: str) -> str:
    """A path to write one file to: not empty (that would be the current folder) and not an existing folder."""
    if not text:
        raise argparse.ArgumentTypeError("empty; name the file to write")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder; name the file to write (in it or elsewhere)")
    return text


__all__ = [
    "eval_limit",
    "file_path",
    "int_at_least",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "positive_ints",
    "share",
    "utf8_text",
]
