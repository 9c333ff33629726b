"""Model card templates. `stem_hf.model_card` renders `stem_model_card.md` (Jinja) for a STEM checkpoint."""

from pathlib import Path

STEM_TEMPLATE = Path(__file__).resolve().parent / "stem_model_card.md"

__all__ = ["STEM_TEMPLATE"]
