"""`stem-hf convert`: reads the command line, converts, prints the report."""

import argparse
import json
import os
from fnmatch import fnmatch

import torch

from stem_hf.accounting import check_local
from stem_hf.cli import PRIOR_CONTEXT, read_texts

from .assets import CORPUS_NAMES, corpora
from .convert import CALIBRATED_INITS, check_source_and_out, convert

DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# What makes a folder hold a model: saving a checkpoint there replaces its config and deletes weight files it does not
# write itself (transformers' stale-shard cleanup removes `model*.safetensors`, even `model.gguf`).
MODEL_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.gguf")
MODEL_FILES += ("*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack")


def model_files(folder: str) -> list[str]:
    """The files in `folder` (not below it) that make it hold a model."""
    if not os.path.isdir(folder):
        return []
    return sorted(name for name in os.listdir(folder) if any(fnmatch(name, pattern) for pattern in MODEL_FILES))


def _tokenizer(args: argparse.Namespace, vocab_size: int, text: str | None):
    """`--tokenizer`, else the source's own (None if it has none). `text` says what would be tokenized (None: nothing):
    then a source without a tokenizer is refused here, before the conversion loads the weights."""
    from transformers import AutoTokenizer

    from .sources import _split_gguf

    if args.tokenizer is not None:
        check_local(args.tokenizer)
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, trust_remote_code=False)
        except (OSError, ValueError, TypeError) as error:
            raise ValueError(f"--tokenizer {args.tokenizer}: no tokenizer loads from it ({error})") from error
        if len(tokenizer) > vocab_size:
            raise ValueError(
                f"--tokenizer {args.tokenizer}: its {len(tokenizer)} tokens do not fit the source's vocabulary of "
                f"{vocab_size}; it is not this model's tokenizer"
            )
        return tokenizer
    path, extra = _split_gguf(args.source)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False, **extra)
    except (OSError, ValueError, TypeError) as error:
        if text is None:
            return None
        raise ValueError(
            f"{args.source} has no tokenizer, and this conversion tokenizes {text}: pass --tokenizer PATH_OR_ID (the "
            "source model's tokenizer), or convert without text: --init projected (or xavier) --refit none "
            f"--calibration --heldout ({type(error).__name__}: {error})"
        ) from error


def run_convert(args: argparse.Namespace) -> dict:
    torch.set_flush_denormal(True)  # dequantized checkpoints hold denormals: 4-5x slower CPU matmuls without this
    table_dtype = DTYPE_ALIASES.get(args.table_dtype, args.table_dtype)
    # Checked before anything loads: the source, OUT, --stem-layers (from the source's config alone), the tokenizer.
    planned = check_source_and_out(args.source, args.out, args.stem_layers, table_dtype)
    found = model_files(args.out)
    if found and not args.overwrite:
        raise FileExistsError(
            f"{args.out} already holds a model ({', '.join(found[:4])}{', ...' if len(found) > 4 else ''}): "
            "converting into it would replace it; pass --overwrite to do so, or choose another folder"
        )
    bundled = corpora() if args.calibration is None or args.heldout is None else None
    calibration = read_texts(args.calibration) if args.calibration is not None else bundled["calibration"]
    heldout = read_texts(args.heldout) if args.heldout is not None else bundled["heldout"]
    heal_options = {
        "train": args.heal_train,
        "anneal": args.heal_anneal,
        "table_lr": args.heal_table_lr,
        "lr": args.heal_lr,
        "precision": args.heal_precision,
    }
    prior_context = args.prior_context
    if prior_context is None and not args.no_prior_context and args.init in CALIBRATED_INITS:
        prior_context = PRIOR_CONTEXT
    texts = [
        what
        for what, given in (
            ("the bundled calibration corpus" if args.calibration is None else "the --calibration files", calibration),
            ("the bundled held-out corpus" if args.heldout is None else "the --heldout files", heldout),
            (f"the prior context {prior_context!r}", prior_context is not None and planned.stem_layers),
        )
        if given
    ]
    tokenizer = _tokenizer(args, planned.vocab_size, " and ".join(texts) if texts else None)
    _, report = convert(
        args.source,
        args.out,
        stem_layers=args.stem_layers,
        init=args.init,
        calibration=calibration,
        calibration_tokens=args.calibration_tokens,
        heldout=heldout,
        heldout_tokens=args.heldout_tokens,
        table_dtype=table_dtype,
        tokenizer=tokenizer,
        prior_context=prior_context,
        refit=args.refit,
        gate_epochs=args.gate_epochs,
        dense_epochs=args.dense_epochs,
        device=args.device,
        heal_tokens=args.heal_tokens,
        heal_options={k: v for k, v in heal_options.items() if v is not None},
        calibration_name=", ".join(args.calibration) if args.calibration is not None else CORPUS_NAMES["calibration"],
        heldout_name=", ".join(args.heldout) if args.heldout is not None else CORPUS_NAMES["heldout"],
        base_model=args.base_model,
        license=args.license,
    )
    print(json.dumps(report, indent=2))
    return report
