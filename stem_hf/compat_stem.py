"""What differs between the transformers releases this code supports, keyed on what the installed transformers offers.

transformers 5.24 renamed the KV cache from `past_key_values` to `cache` in model forwards, masks, outputs and
`generate`. The model's code is written with `cache`; `takes_cache` lets a forward take either name and shows
transformers the one it passes, and `CACHE_ARG` is the name to give transformers' own functions and output classes.

Copied next to the weights by `save_pretrained`: imports nothing beyond torch and transformers.
"""

import functools
import inspect
import re
import warnings
from collections.abc import Callable

import transformers
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.utils import TransformersKwargs

# The transformers releases this code is tested with; kept in step with setup.cfg and recorded in every saved config.
SUPPORTED_TRANSFORMERS = ">=5.18,<5.25"
CACHE_ARGS = ("cache", "past_key_values")  # the name from 5.24 on, and the name before


def _cache_arg() -> str:
    """The name the installed transformers gives the KV cache: the field of its output classes, which its mask
    functions must take too. Anything else is a transformers this code cannot run on without being silently wrong."""
    fields = BaseModelOutputWithPast.__dataclass_fields__
    names = [name for name in CACHE_ARGS if name in fields]
    if len(names) != 1 or names[0] not in inspect.signature(create_causal_mask).parameters:
        raise ImportError(
            f"transformers {transformers.__version__} passes the KV cache under a name this STEM code does not know "
            f"(it knows {' and '.join(CACHE_ARGS)}; it is tested with transformers{SUPPORTED_TRANSFORMERS}): install "
            f"a supported release (pip install 'transformers{SUPPORTED_TRANSFORMERS}'), or refresh the checkpoint's "
            "code with an up-to-date stem-hf (`stem-hf refresh-code CHECKPOINT`)"
        )
    return names[0]


CACHE_ARG = _cache_arg()


def takes_cache(forward: Callable) -> Callable:
    """Decorates a forward written with a `cache` parameter: it also takes the cache as `past_key_values`, the name
    transformers before 5.24 passes and code written for it uses, and its signature (which `generate` inspects) shows
    the name the installed transformers passes. Giving both names is an error."""
    signature = inspect.signature(forward)
    if "cache" not in signature.parameters:
        raise TypeError(f"takes_cache: {forward.__qualname__} has no `cache` parameter")
    parameters = [p.replace(name=CACHE_ARG) if p.name == "cache" else p for p in signature.parameters.values()]

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        if "past_key_values" in kwargs:  # else nothing to rename: every decoder layer's call from transformers 5.24 on
            kwargs = rename_cache(kwargs, "cache", forward.__qualname__)
        return forward(*args, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=parameters)
    return wrapper


def rename_cache(kwargs: dict, name: str, owner: str) -> dict:
    """`kwargs` with the KV cache under `name`, whichever of `CACHE_ARGS` it came under. Giving both is an error (a
    name given as None does not count: wrappers pass one name as None)."""
    # Loops, not comprehensions: every decoder layer renames once per forward under transformers before 5.24.
    given, value = False, None
    for arg in CACHE_ARGS:
        if arg in kwargs:
            given, cache = True, kwargs.pop(arg)
            if cache is not None and value is not None:
                raise TypeError(
                    f"{owner}: got both `cache` and `past_key_values`, two names of the one KV cache argument; give one"
                )
            value = cache if cache is not None else value
    if given:
        kwargs[name] = value
    return kwargs


# From 5.24 on an attention layer updates every cache itself, handing it the forward's keywords, where continuous
# batching's paged cache (no `Cache`) finds its indices; before, the attention function was given that cache as `cache`
# and updated it. Read off the cache's name, which changed in the same release: a proxy that holds for the supported
# range (tests/test_compat.py runs continuous batching under 5.18, 5.23 and 5.24), to be checked at the next release.
LAYER_UPDATES_PAGED_CACHE = CACHE_ARG == "cache"
# What continuous batching (`generate_batch`, `init_continuous_batching`, `transformers serve`) gives a model forward
# beyond its named inputs, for paged attention, under every supported transformers (its `PagedAttentionArgs`, which it
# does not export; `tests/test_compat.py` compares them): passed on to the attention layers, as Llama's forward does.
PAGED_ATTENTION_KWARGS = frozenset(
    {"block_table", "logits_indices", "logits_processor_args", "read_index", "write_index"}
    | {"max_seqlen_k", "max_seqlen_q"}  # 5.18's names of `max_length_k` and `max_length_q`
)
# The extra keywords a model forward passes on: the installed transformers' `TransformersKwargs`, its debugging
# switches (read by `merge_with_config_defaults`, allowed by `generate`) and continuous batching's. Dropped, as Llama
# ignores them: `token_type_ids`, which some tokenizers return and a decoder without token types ignores, and the
# `tokenizer` that `generate(..., tokenizer=...)` (for `stop_strings`) hands every forward.
MODEL_KWARGS = frozenset(TransformersKwargs.__annotations__) | {"debug_io", "debug_io_dir", "prune_layers"}
MODEL_KWARGS |= PAGED_ATTENTION_KWARGS
IGNORED_KWARGS = frozenset({"token_type_ids", "tokenizer"})


def check_model_kwargs(owner: str, kwargs: dict) -> None:
    """Raises on a keyword a model forward would otherwise swallow into `**kwargs` (a cache under an unknown name would
    be ignored, silently); drops the `IGNORED_KWARGS`."""
    # Membership tests, not set algebra on `kwargs.keys()`: torch 2.11's dynamo cannot trace `frozenset & dict_keys`.
    for name in [name for name in kwargs if name in IGNORED_KWARGS]:
        del kwargs[name]
    unknown = sorted(name for name in kwargs if name not in MODEL_KWARGS)
    if unknown:
        raise TypeError(
            f"{owner}.forward got unexpected keyword argument(s) {', '.join(map(repr, unknown))}: it takes "
            f"{' or '.join(map(repr, CACHE_ARGS))} for the KV cache, `stem_input_ids`, the usual model inputs, and "
            f"transformers' {', '.join(sorted(MODEL_KWARGS))}"
        )


def _minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def parse_range(supported: object) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The bounds of a range of the form `>=A.B,<C.D` as ((A, B), (C, D)); None for anything else (a config written by
    hand, or before ranges were recorded)."""
    match = re.fullmatch(r">=(\d+\.\d+),<(\d+\.\d+)", supported) if isinstance(supported, str) else None
    return (_minor(match.group(1)), _minor(match.group(2))) if match else None


def supports_transformers(version: str, supported: str = SUPPORTED_TRANSFORMERS) -> bool:
    """Whether a transformers `version` lies in `supported`, a range of the form `>=A.B,<C.D` (by minor release: the
    pre-releases of a minor count as it)."""
    low, high = parse_range(supported)
    return low <= _minor(version) < high


def check_transformers_version(version: str | None = None) -> None:
    """Warns, naming the range and what to do, when the installed transformers is outside the range this code is
    tested with: a release outside it may change what the model's forward is given, as 5.24 did."""
    version = version or transformers.__version__
    if not supports_transformers(version):
        warnings.warn(
            f"this STEM model's code is tested with transformers{SUPPORTED_TRANSFORMERS} and transformers {version} "
            "is installed: its outputs, cached generation above all, may differ from a supported release's. Install "
            f"one (pip install 'transformers{SUPPORTED_TRANSFORMERS}'), or refresh the checkpoint's code with an "
            "up-to-date stem-hf (`stem-hf refresh-code CHECKPOINT`)",
            UserWarning,
            stacklevel=2,
        )


__all__ = [
    "CACHE_ARG",
    "CACHE_ARGS",
    "IGNORED_KWARGS",
    "LAYER_UPDATES_PAGED_CACHE",
    "MODEL_KWARGS",
    "PAGED_ATTENTION_KWARGS",
    "SUPPORTED_TRANSFORMERS",
    "check_model_kwargs",
    "check_transformers_version",
    "parse_range",
    "rename_cache",
    "supports_transformers",
    "takes_cache",
]
