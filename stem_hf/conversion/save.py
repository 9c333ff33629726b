"""A converted checkpoint on disk: the weights, the tokenizer, the conversion report and the model card."""

import copy
import os

from .. import StemForCausalLM, write_model_card
from ..storage_stem import read_save_id
from .report import ConversionReport, write_report

__all__ = ["save_conversion"]


def save_conversion(out: str | os.PathLike, stem: StemForCausalLM, tokenizer: object, report: ConversionReport) -> None:
    """Saves `stem` to `out` with `tokenizer` (when there is one), the report (tied to the weights just saved: the
    model card leaves it out once a later save replaces them) and a model card describing both."""
    stem.save_pretrained(out)
    report.save_id, report.saved = read_save_id(out), True
    if tokenizer is not None:
        tokenizer = copy.deepcopy(tokenizer)
        bos = stem.config.bos_token_id
        if bos is not None and tokenizer.bos_token_id == bos:
            # Every calibration chunk started with BOS and the tables hold an exact row for it at position 0: the saved
            # tokenizer prepends it by itself, so pipelines and lm-eval feed the model what it was fit on.
            tokenizer.add_bos_token = True
        tokenizer.save_pretrained(out)
    write_report(out, report.to_dict())
    write_model_card(out)  # again, now that the report it describes is there
