"""`stem-hf convert` and `stem-hf demo`: their options, and the run that reads them, converts and prints the report.
Imports nothing heavy until a command runs."""

import argparse
import json
import os
from fnmatch import fnmatch

from ..accounting import check_local
from ..assets import CORPUS_NAMES, corpora, read_texts
from ..checkpoint_stem import CONFIG_NAME
from ..cli_args import non_negative_float, non_negative_int, positive_float, positive_int, share, utf8_text
from .options import CALIBRATED_INITS, DTYPE_ALIASES, HEAL_PRECISIONS, HEAL_TRAINABLE, INITS, PRIOR_CONTEXT, REFITS

__all__ = ["MODEL_FILES", "add_parsers", "model_files", "run", "run_convert"]

# What makes a folder hold a model: saving a checkpoint there replaces its config and deletes weight files it does not
# write itself (transformers' stale-shard cleanup removes `model*.safetensors`, even `model.gguf`).
MODEL_FILES = (CONFIG_NAME, "*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.gguf")
MODEL_FILES += ("*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack")


def add_parsers(commands: argparse._SubParsersAction) -> None:
    """Adds `demo` and `convert` to the `stem-hf` subcommands."""
    demo = commands.add_parser("demo", help="convert SmolLM2-135M (or --source) to STEM, reload it, compare with dense")
    demo.add_argument("--out", default="runs/demo", help="where to save the converted checkpoint")
    demo.add_argument("--source", default=None, help="a dense checkpoint (default: the embedded SmolLM2-135M GGUF)")
    demo.add_argument("--calibration-tokens", type=positive_int, default=50_000)
    demo.add_argument("--heal-tokens", type=non_negative_int, default=20_000, help="healing budget (0: none)")
    demo.add_argument(
        "--heal-precision", choices=HEAL_PRECISIONS, default="auto", help="as convert's, but the default is auto"
    )
    demo.add_argument("--tiny", action="store_true", help="the one-second example on a random tiny model instead")

    convert = commands.add_parser("convert", help="convert a dense Llama/Mistral/Qwen2/Qwen3 checkpoint to STEM")
    convert.add_argument("source", help="a checkpoint folder, a Hub id, or a .gguf file")
    convert.add_argument("out", help="the folder to write the STEM checkpoint to (not the source's)")
    convert.add_argument("--overwrite", action="store_true", help="write into an OUT that already holds a model")
    convert.add_argument(
        "--tokenizer", metavar="PATH_OR_ID", help="the tokenizer for the text, where the source has none of its own"
    )
    convert.add_argument("--stem-layers", default="1/3", help='"1/3", "1/2", "full", "1/N" or "1,4,7"')
    convert.add_argument("--init", default="fitted", choices=INITS)
    convert.add_argument("--calibration", nargs="*", default=None, help="text files (default: the bundled corpus)")
    convert.add_argument("--heldout", nargs="*", default=None, help="text files (default: the bundled held-out set)")
    convert.add_argument("--calibration-tokens", type=positive_int, default=150_000)
    convert.add_argument("--heldout-tokens", type=positive_int, default=20_000)
    convert.add_argument(
        "--table-dtype", default="bfloat16", choices=["bfloat16", "bf16", "float16", "fp16", "float32", "fp32"]
    )
    convert.add_argument(
        "--in-memory",
        action="store_true",
        help="build the tables in memory and save at the end (default without healing: stream them to OUT as made)",
    )
    convert.add_argument("--max-shard-size", default="50GB", help='largest weight file, e.g. "5GB" (default: 50GB)')
    convert.add_argument(
        "--offload-store",
        action="store_true",
        help="also write the token-major offload store (stem-hf offload-store) into OUT",
    )
    _add_text_options(convert)


def _add_text_options(convert: argparse.ArgumentParser) -> None:
    context = convert.add_mutually_exclusive_group()
    context.add_argument(
        "--prior-context",
        type=utf8_text,
        help="fitted/mean: rare and unseen tokens' rows lean on a ridge map from their embedding and their FFN input "
        f"after BOS (if any) and this text (default for fitted/mean: {PRIOR_CONTEXT!r}; see --no-prior-context)",
    )
    context.add_argument(
        "--no-prior-context", action="store_true", help="fitted/mean: that ridge map from the embedding alone"
    )
    convert.add_argument(
        "--refit",
        choices=REFITS,
        help="closed-form refit of output projections after the tables are set (default: all for fitted, else none)",
    )
    convert.add_argument(
        "--gate-epochs",
        type=non_negative_int,
        help="epochs of local training of the STEM layers' gates (default: 5 with --refit sequential/all, else 0)",
    )
    convert.add_argument(
        "--dense-epochs",
        type=non_negative_int,
        help="epochs of local training of the dense layers' gate and up (default: 5 with --refit all, else 0)",
    )
    convert.add_argument("--heal-tokens", type=non_negative_int, default=0, help="distil dense into STEM on N tokens")
    # Left unset, the healing options take `heal`'s defaults (the anneal's by init: `ANNEAL`).
    convert.add_argument("--heal-train", choices=HEAL_TRAINABLE, help="what healing trains (default: all)")
    convert.add_argument(
        "--heal-anneal", type=share, help="share of the healing steps that blend W_up out (default: 0 for fitted, mean)"
    )
    convert.add_argument("--heal-table-lr", type=positive_float, help="learning rate of the table rows")
    convert.add_argument("--heal-lr", type=non_negative_float, help="learning rate of the other trained weights")
    convert.add_argument(
        "--heal-precision",
        choices=HEAL_PRECISIONS,
        help="bf16: healing under bf16 autocast; auto: bf16 where the device computes it natively (default: fp32)",
    )
    convert.add_argument("--device", default=None, help="where healing runs, e.g. cuda (default: cpu)")
    convert.add_argument(
        "--base-model", type=utf8_text, help="the source's Hub id, for the model card (default: SOURCE if a Hub id)"
    )
    convert.add_argument(
        "--license", type=utf8_text, help='the source\'s license id for the model card, e.g. "apache-2.0"'
    )


def model_files(folder: str) -> list[str]:
    """The files in `folder` (not below it) that make it hold a model."""
    if not os.path.isdir(folder):
        return []
    return sorted(name for name in os.listdir(folder) if any(fnmatch(name, pattern) for pattern in MODEL_FILES))


def _tokenizer(args: argparse.Namespace, vocab_size: int, text: str | None):
    """`--tokenizer`, else the source's own (None if it has none). `text` says what would be tokenized (None: nothing):
    then a source without a tokenizer is refused here, before the conversion loads the weights."""
    from transformers import AutoTokenizer

    from .sources import split_gguf

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
    path, extra = split_gguf(args.source)
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


def run(args: argparse.Namespace) -> dict:
    """Runs `stem-hf demo` or `stem-hf convert` as parsed."""
    if args.command == "demo":
        from ..demo import run_demo

        return run_demo(args.out, args.source, args.calibration_tokens, args.heal_tokens, args.heal_precision)
    return run_convert(args)


def run_convert(args: argparse.Namespace) -> dict:
    """Runs `stem-hf convert` as parsed: checks what it can before anything loads, converts, prints the report."""
    import torch

    from .convert import convert
    from .sources import check_source_and_out

    torch.set_flush_denormal(True)  # dequantized checkpoints hold denormals, which CPUs multiply slowly
    table_dtype = DTYPE_ALIASES.get(args.table_dtype, args.table_dtype)
    max_shard_size = _shard_size(args.max_shard_size)
    # Checked before anything loads: the source, OUT, --stem-layers (from the source's config alone), the tokenizer.
    planned = check_source_and_out(args.source, args.out, args.stem_layers, table_dtype)
    found = model_files(args.out)
    if found and not args.overwrite:
        raise FileExistsError(
            f"{args.out} already holds a model ({', '.join(found[:4])}{', ...' if len(found) > 4 else ''}): "
            "converting into it would replace it; pass --overwrite to do so, or choose another folder"
        )
    calibration, heldout = _texts(args)
    prior_context = args.prior_context
    if prior_context is None and not args.no_prior_context and args.init in CALIBRATED_INITS:
        prior_context = PRIOR_CONTEXT
    read = _tokenized(args, calibration, heldout, prior_context if planned.stem_layers else None)
    tokenizer = _tokenizer(args, planned.vocab_size, read)
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
        heal_options=_heal_options(args),
        calibration_name=", ".join(args.calibration) if args.calibration is not None else CORPUS_NAMES["calibration"],
        heldout_name=", ".join(args.heldout) if args.heldout is not None else CORPUS_NAMES["heldout"],
        base_model=args.base_model,
        license=args.license,
        stream=False if args.in_memory else None,
        max_shard_size=max_shard_size,
        offload_store=args.offload_store,
    )
    print(json.dumps(report, indent=2))
    return report


def _shard_size(size: str) -> str | int:
    """`--max-shard-size` checked before anything loads: bytes, or a size like "5GB"."""
    from transformers.utils.hub import convert_file_size_to_int

    try:
        value = int(size) if size.isdigit() else size
        if convert_file_size_to_int(value) <= 0:
            raise ValueError
    except ValueError:
        raise ValueError(f'--max-shard-size {size!r}: not a size (bytes, or e.g. "5GB", "500MB")') from None
    return value


def _texts(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The calibration and held-out texts: the files given, else the bundled corpus."""
    bundled = corpora() if args.calibration is None or args.heldout is None else None
    calibration = read_texts(args.calibration) if args.calibration is not None else bundled["calibration"]
    heldout = read_texts(args.heldout) if args.heldout is not None else bundled["heldout"]
    return calibration, heldout


def _tokenized(args: argparse.Namespace, calibration: list, heldout: list, prior_context: str | None) -> str | None:
    """What the conversion tokenizes, for the error when there is no tokenizer (None: nothing)."""
    read = [
        what
        for what, given in (
            ("the bundled calibration corpus" if args.calibration is None else "the --calibration files", calibration),
            ("the bundled held-out corpus" if args.heldout is None else "the --heldout files", heldout),
            (f"the prior context {prior_context!r}", prior_context is not None),
        )
        if given
    ]
    return " and ".join(read) if read else None


def _heal_options(args: argparse.Namespace) -> dict:
    """The healing options given: left unset, `heal` takes its defaults."""
    options = {
        "train": args.heal_train,
        "anneal": args.heal_anneal,
        "table_lr": args.heal_table_lr,
        "lr": args.heal_lr,
        "precision": args.heal_precision,
    }
    return {k: v for k, v in options.items() if v is not None}
