"""The knowledge lab: small STEM and dense models trained from scratch on a synthetic world of facts, so that recall,
capacity, editing by rows and the angular spread of tables are measured on models that know something.

`corpus` makes the world and its tokenizer, `train` the models, `measure` the measures, `run` puts them together
(`stem-hf lab`, `benchmarks/knowledge_lab.py`). See docs/knowledge_lab.md.
"""

from .corpus import LabWorld, build_tokenizer, make_world
from .measure import evaluate_edits, localization, recall
from .train import QUICK, REGIMES, LabSettings, lab_configs, train_lab_model

__all__ = [
    "QUICK",
    "REGIMES",
    "LabSettings",
    "LabWorld",
    "build_tokenizer",
    "evaluate_edits",
    "lab_configs",
    "localization",
    "make_world",
    "recall",
    "train_lab_model",
]
