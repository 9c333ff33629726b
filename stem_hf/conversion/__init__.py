"""Dense Llama-family checkpoint -> STEM: table initialization from the dense weights and calibration text.

The names below load on first use, so that `stem-hf` parses its arguments without importing torch.
"""

import importlib
import sys
import types

_EXPORTS = {
    "INITS": "options",
    "SUPPORTED_ARCHITECTURES": "sources",
    "ConversionPlan": "plan",
    "ConversionReport": "report",
    "ConversionText": "text",
    "convert": "convert",
    "load_source": "sources",
    "run_conversion": "convert",
    "stem_config_from_dense": "sources",
}


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


class _Package(types.ModuleType):
    """Importing a submodule binds it to the package attribute of its name: `convert` the module would then hide
    `convert` the function. A name exported here always resolves to the export."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = sorted(_EXPORTS)
