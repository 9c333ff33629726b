"""`stem-hf convert`: reads the command line, converts, prints the report."""

import argparse
import json

import torch

from stem_hf.cli import PRIOR_CONTEXT, read_texts

from .assets import CORPUS_NAMES, corpora
from .convert import CALIBRATED_INITS, convert

DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def run_convert(args: argparse.Namespace) -> dict:
    torch.set_flush_denormal(True)  # dequantized checkpoints hold denormals: 4-5x slower CPU matmuls without this
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
    _, report = convert(
        args.source,
        args.out,
        stem_layers=args.stem_layers,
        init=args.init,
        calibration=calibration,
        calibration_tokens=args.calibration_tokens,
        heldout=heldout,
        heldout_tokens=args.heldout_tokens,
        table_dtype=DTYPE_ALIASES.get(args.table_dtype, args.table_dtype),
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
