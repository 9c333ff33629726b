"""Optional dependencies: imported where they are used, with an error that names the extra that installs them."""

import importlib
from types import ModuleType

EXTRAS = {"lm_eval": "eval", "matplotlib": "demo", "peft": "peft", "gguf": "demo"}


def require(module: str) -> ModuleType:
    """Imports `module`, or raises an ImportError naming the stem-hf extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        extra = EXTRAS[module.split(".")[0]]
        raise ImportError(f"{module} is not installed: it comes with pip install 'stem-hf[{extra}]'") from error


__all__ = ["EXTRAS", "require"]
