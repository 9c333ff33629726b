"""Dense Llama-family checkpoint -> STEM: table initialization from the dense weights and calibration text.

`convert` is the driver (`convert.py`); each step is a module of its own: `sources` (load the dense model, build the
STEM one), `text` (calibration and held-out chunks), `init_tables`, `refit`, `heal` (with `blend`), `report`, `save`.
"""

from .convert import convert, run_conversion
from .options import INITS
from .plan import ConversionPlan
from .report import ConversionReport
from .sources import SUPPORTED_ARCHITECTURES, load_source, stem_config_from_dense
from .text import ConversionText

__all__ = [
    "INITS",
    "SUPPORTED_ARCHITECTURES",
    "ConversionPlan",
    "ConversionReport",
    "ConversionText",
    "convert",
    "load_source",
    "run_conversion",
    "stem_config_from_dense",
]
