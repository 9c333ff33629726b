"""Dense Llama-family checkpoint -> STEM: table initialization from the dense weights and calibration text."""

from .convert import INITS, convert
from .sources import SUPPORTED_ARCHITECTURES, load_source, stem_config_from_dense

__all__ = ["INITS", "SUPPORTED_ARCHITECTURES", "convert", "load_source", "stem_config_from_dense"]
