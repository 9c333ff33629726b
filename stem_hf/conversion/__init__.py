"""Dense Llama-family checkpoint -> STEM: table initialization from the dense weights and calibration text.

The names below load on first use, so that `stem-hf` parses its arguments without importing torch.
"""

import importlib

_EXPORTS = {
    "INITS": "options",
    "SUPPORTED_ARCHITECTURES": "sources",
    "convert": "convert",
    "load_source": "sources",
    "stem_config_from_dense": "sources",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


__all__ = sorted(_EXPORTS)
