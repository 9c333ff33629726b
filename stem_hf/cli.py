"""The `stem-hf` command."""

import argparse
import json
import os
import sys
import tempfile

from .assets import read_texts
from .cli_args import eval_limit, file_path, non_negative_int, positive_float, positive_int, utf8_text
from .conversion.cli import add_parsers as add_conversion_parsers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stem-hf", description="STEM models for Hugging Face Transformers")
    commands = parser.add_subparsers(dest="command", required=True)

    info = commands.add_parser("info", help="parameter counts and FLOPs per token of a STEM checkpoint vs dense")
    info.add_argument("checkpoint", help="a STEM checkpoint folder or Hub id (only its config is read)")
    info.add_argument("--context-length", type=positive_int, default=2048, help="positions each token attends to")

    add_conversion_parsers(commands)
    store = commands.add_parser(
        "offload-store", help="write a checkpoint's tables token-major to one file, for StemOffloadEngine(store=...)"
    )
    store.add_argument("checkpoint", help="a local STEM checkpoint folder")
    store.add_argument(
        "--out", type=file_path, help="the store's path (default: CHECKPOINT/stem-offload-store.safetensors)"
    )

    verify = commands.add_parser(
        "verify", help="check a checkpoint's files as a load does and scan every weight for NaN and inf"
    )
    verify.add_argument("checkpoint", help="a local STEM checkpoint folder")

    _add_eval_parser(commands)
    _add_hub_parsers(commands)
    _add_pretrain_parser(commands)
    _add_edit_parser(commands)

    from .lab.cli import add_parser as add_lab_parser

    add_lab_parser(commands)

    _add_analyze_parser(commands)
    return parser


def _add_eval_parser(commands) -> None:
    """lm-eval: `stem-hf eval`."""
    evaluate = commands.add_parser("eval", help="lm-eval harness tasks on a checkpoint, results saved as JSON")
    evaluate.add_argument("checkpoint", help="a checkpoint folder or Hub id (STEM or dense, with a tokenizer)")
    evaluate.add_argument("--tasks", required=True, help="comma-separated lm-eval tasks or groups, e.g. stem_offline")
    evaluate.add_argument("--include-path", help="a folder of your own lm-eval task YAMLs")
    evaluate.add_argument("--device", default="cpu", help="where the dense weights run, e.g. cuda")
    evaluate.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    evaluate.add_argument(
        "--keep-tables-on-cpu",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep STEM tables in host memory, as StemConfig.keep_tables_on_cpu does (default); "
        "--no-keep-tables-on-cpu moves them to --device too",
    )
    # The old, inverted spelling of --no-keep-tables-on-cpu: accepted with a deprecation warning.
    evaluate.add_argument("--tables-on-device", action="store_true", help=argparse.SUPPRESS)
    evaluate.add_argument("--batch-size", type=positive_int, default=1)
    evaluate.add_argument("--limit", type=eval_limit, help="examples per task (a fraction of them if below 1)")
    evaluate.add_argument("--num-fewshot", type=non_negative_int)
    evaluate.add_argument(
        "--output",
        help="results JSON, merged task by task (default: CHECKPOINT/lm_eval_results.json for a folder, "
        "./lm_eval_results.json for a Hub id)",
    )


def _add_hub_parsers(commands) -> None:
    """Model cards and the Hub: `stem-hf card`, `stem-hf push`, `stem-hf refresh-code`."""
    card = commands.add_parser("card", help="write or refresh the model card (README.md) of a STEM checkpoint folder")
    card.add_argument("checkpoint")
    card.add_argument("--repo-id", type=utf8_text, help="the Hub id to show in the usage snippet")
    card.add_argument("--force", action="store_true", help="replace a README.md that stem-hf did not write")

    push = commands.add_parser("push", help="upload a STEM checkpoint folder (weights, tables, code, tokenizer, card)")
    push.add_argument("checkpoint")
    push.add_argument("repo_id")
    push.add_argument("--private", action="store_true")
    push.add_argument("--revision", help="branch to push to (created if missing)")
    push.add_argument("--commit-message", type=utf8_text)

    refresh = commands.add_parser(
        "refresh-code", help="replace the model code a STEM checkpoint carries (folder or Hub repo) with this stem-hf's"
    )
    refresh.add_argument("target", help="a STEM checkpoint folder or Hub repo id (its code never runs)")
    refresh.add_argument("--check", action="store_true", help="only list the files that differ; exit status 1 if any")
    refresh.add_argument("--revision", help="Hub branch to read and commit to (default: main)")
    refresh.add_argument("--create-pr", action="store_true", help="open a Hub pull request instead of committing")
    refresh.add_argument(
        "--force", action="store_true", help="replace code that a newer stem-hf saved (for a newer transformers range)"
    )


def _add_pretrain_parser(commands) -> None:
    """Dense vs STEM from scratch: `stem-hf pretrain`."""
    pretrain = commands.add_parser(
        "pretrain", help="train a dense and a STEM model of matching active parameters from scratch, side by side"
    )
    pretrain.add_argument("corpus", nargs="+", help="text files")
    pretrain.add_argument("--out", default="runs/pretrain")
    pretrain.add_argument(
        "--vocab-size", type=positive_int, default=8192, help="of the BPE tokenizer trained on the corpus"
    )
    pretrain.add_argument("--hidden-size", type=positive_int, default=128)
    pretrain.add_argument("--intermediate-size", type=positive_int, default=512, help="the dense model's")
    pretrain.add_argument("--layers", type=positive_int, default=6)
    pretrain.add_argument("--heads", type=positive_int, default=4)
    pretrain.add_argument("--kv-heads", type=positive_int, default=2)
    pretrain.add_argument("--context", type=positive_int, default=128)
    pretrain.add_argument("--stem-layers", default="1/2")
    pretrain.add_argument("--batch-size", type=positive_int, default=16)
    pretrain.add_argument("--steps", type=positive_int, default=400)
    pretrain.add_argument("--lr", type=positive_float, default=3e-3)
    pretrain.add_argument("--table-lr", type=positive_float, help="default: --lr (the stem-hf recipe only)")
    pretrain.add_argument(
        "--recipe",
        choices=("stem-hf", "paper"),
        default="stem-hf",
        help="stem-hf (row-sparse tables, undecayed) or paper (the reference code's AdamW); see docs/training.md",
    )
    pretrain.add_argument("--eval-every", type=positive_int, default=50)


def _add_edit_parser(commands) -> None:
    """Knowledge editing by rows: `stem-hf edit`."""
    edit = commands.add_parser("edit", help="answer a prompt before and after a knowledge edit by table rows")
    edit.add_argument("checkpoint")
    edit.add_argument("--source", type=utf8_text, required=True, help='text whose lookups change, e.g. " France"')
    edit.add_argument("--target", type=utf8_text, required=True, help='text whose rows they take, e.g. " Germany"')
    edit.add_argument("--prompt", type=utf8_text, required=True)
    edit.add_argument(
        "--strategy",
        default="clone",
        choices=["clone", "filler", "subset", "mean", "pad"],
        help="for source and target of different lengths: repeat the target's tokens (clone), fill with the pad token "
        "(filler), spread over the target (subset), or its mean row (mean); pad: the old name of clone",
    )
    edit.add_argument("-n", "--max-new-tokens", type=positive_int, default=16)


def _add_analyze_parser(commands) -> None:
    """Table analyses: `stem-hf analyze`."""
    analyze = commands.add_parser("analyze", help="angular spread of table rows, activated parameters vs context")
    analyze.add_argument("checkpoint")
    analyze.add_argument(
        "--dense",
        help="the dense source (folder, Hub id or .gguf), for the reference spread (default: the local source its "
        "conversion_report.json names, if any)",
    )
    analyze.add_argument("--text", nargs="*", help="text files (default: the bundled held-out corpus)")
    analyze.add_argument("--out", default="runs/analysis")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "info":
        from .accounting import load_config, summarize

        print(json.dumps(summarize(load_config(args.checkpoint), args.context_length), indent=2))
    elif args.command == "demo" and args.tiny:
        from .demo import run_tiny_demo

        run_tiny_demo(args.out)
    elif args.command in ("demo", "convert"):
        from .conversion.cli import run

        run(args)
    elif args.command == "offload-store":
        from .accounting import check_stem
        from .offload import write_offload_store

        check_stem(args.checkpoint, hub=False)  # a STEM folder's config, read as JSON, before anything else
        print(f"wrote {write_offload_store(args.checkpoint, args.out)}")
    elif args.command == "verify":
        run_verify(args)
    elif args.command == "eval":
        run_eval(args)
    elif args.command == "card":
        from .accounting import check_stem
        from .model_card import as_utf8, write_model_card

        check_stem(args.checkpoint, hub=False)  # a local STEM folder, even where a hand-written card is kept
        path = write_model_card(args.checkpoint, repo_id=args.repo_id, overwrite=args.force)
        shown = as_utf8(os.fspath(path or args.checkpoint))  # a folder's name need not be UTF-8, nor stdout forgiving
        print(f"wrote {shown}" if path else f"kept the hand-written {shown}/README.md (--force replaces it)")
    elif args.command == "pretrain":
        from .pretrain import PretrainSettings, pretrain

        settings = PretrainSettings(
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            context=args.context,
            stem_layers=args.stem_layers,
            batch_size=args.batch_size,
            steps=args.steps,
            lr=args.lr,
            table_lr=args.table_lr,
            recipe=args.recipe,
            eval_every=args.eval_every,
        )
        result = pretrain(read_texts(args.corpus), args.out, settings)
        summary = {k: v for k, v in result.items() if k != "runs"}
        summary["final_valid_loss"] = {name: run["final_valid_loss"] for name, run in result["runs"].items()}
        print(json.dumps(summary, indent=2))
    elif args.command == "edit":
        run_edit(args)
    elif args.command == "lab":
        from .lab.cli import run as run_lab

        run_lab(args)
    elif args.command == "analyze":
        run_analyze(args)
    elif args.command == "push":
        from .accounting import check_local
        from .hub import push_checkpoint

        check_local(args.checkpoint, hub=False)  # named as typed, before anything reads it
        kwargs = {"private": args.private or None, "revision": args.revision, "commit_message": args.commit_message}
        print(push_checkpoint(args.checkpoint, args.repo_id, **kwargs))
    elif args.command == "refresh-code":
        run_refresh(args)


def run_verify(args: argparse.Namespace) -> dict:
    """`stem-hf verify`: prints the report as JSON; exits 1 if any weight holds NaN or inf."""
    from .accounting import check_stem
    from .verify import verify_checkpoint

    check_stem(args.checkpoint, hub=False)
    report = verify_checkpoint(args.checkpoint)
    print(json.dumps(report, indent=2))
    if report["non_finite"]:
        raise SystemExit(f"{args.checkpoint}: {len(report['non_finite'])} tensor(s) hold NaN or inf (listed above)")
    return report


def run_refresh(args: argparse.Namespace) -> None:
    """`stem-hf refresh-code`: prints which files differ or were replaced; with `--check`, exits 1 if any differ."""
    from .refresh import refresh_code

    options = {"revision": args.revision, "create_pr": args.create_pr, "force": args.force}
    result = refresh_code(args.target, check_only=args.check, **options)
    if not result.changed:
        print(f"{result.target}: the code is this stem-hf's already; nothing to change")
    elif result.check_only:
        print(f"{result.target}: differs from this stem-hf's code in {', '.join(result.changed)}")
        print(f"run `stem-hf refresh-code {result.target}` to replace them")
        raise SystemExit(1)
    else:
        print(f"{result.target}: replaced {', '.join(result.changed)}")
        if result.commit_url:
            print(result.commit_url)


def _load_tokenizer(checkpoint: str):
    """The tokenizer of a STEM checkpoint, refused unless its config.json says STEM: never the checkpoint's own code."""
    from transformers import AutoTokenizer

    from .accounting import check_stem

    check_stem(checkpoint)
    return AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=False)


def _load_model(checkpoint: str):
    """This package's `StemForCausalLM`, not the code copied next to the weights (call `_load_tokenizer` first)."""
    from . import StemForCausalLM

    return StemForCausalLM.from_pretrained(checkpoint).eval()


def _converted_from(checkpoint: str) -> str | None:
    """The local dense source a converted checkpoint's report names, if it is still there."""
    from .checkpoint_stem import REPORT_FILE

    path = os.path.join(checkpoint, REPORT_FILE)
    if not os.path.isfile(path):
        return None
    from .model_card import provenance_matches

    try:
        with open(path) as f:
            report = json.load(f)
        source = report.get("source")
    except (json.JSONDecodeError, AttributeError) as error:
        raise ValueError(f"{path}: not a conversion report ({error}); name the dense source with --dense") from error
    if not provenance_matches(report, checkpoint):
        return None  # the report of weights saved over since: its source is not this model's
    # A relative path is as convert was given it: resolved from the current directory, as `--dense` would be.
    return source if isinstance(source, str) and os.path.exists(source) else None


def run_analyze(args: argparse.Namespace) -> dict:
    from .analysis import run_analysis
    from .conversion.sources import check_source_type, load_source

    tokenizer = _load_tokenizer(args.checkpoint)
    source = args.dense or _converted_from(args.checkpoint)
    if source:
        check_source_type(source)  # from its config.json, before any model loads; its own code never runs
    model = _load_model(args.checkpoint)
    if args.text:
        texts = read_texts(args.text)
    else:
        from .assets import corpora

        texts = corpora()["heldout"]
    dense = load_source(source)[0].eval() if source else None
    result = run_analysis(model, tokenizer, texts, args.out, dense)
    summary = {
        "p95_abs_cos_tables": {k: v["p95_abs_cos"] for k, v in result["table_spread"].items()},
        "p95_abs_cos_dense_up": {k: v["p95_abs_cos"] for k, v in (result.get("dense_up_spread") or {}).items()},
        "activated_table_params": {k: v["activated_table_params"] for k, v in result["activated"].items()},
        "out": args.out,
    }
    print(json.dumps(summary, indent=2))
    return result


def run_edit(args: argparse.Namespace) -> tuple[str, str]:
    import torch

    from .editing import StemEdit, StemEditor, current_strategy, find_occurrences

    # Everything the text can get wrong is checked before the model loads.
    if not args.prompt:
        raise ValueError("--prompt: empty; the model needs some text to continue")
    tokenizer = _load_tokenizer(args.checkpoint)
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise ValueError(f"--prompt: {args.prompt!r} tokenizes to no token; the model needs some text to continue")
    args.strategy = current_strategy(args.strategy)  # an old name warns once, not at each tokenization below
    edit = StemEdit.from_text(tokenizer, args.source, args.target, args.strategy)
    if not find_occurrences(ids, edit.source) and not args.source.startswith(" "):
        # Mid-sentence words carry their leading space in most BPE vocabularies.
        spaced = StemEdit.from_text(tokenizer, " " + args.source, " " + args.target.lstrip(), args.strategy)
        edit = spaced if find_occurrences(ids, spaced.source) else edit
    model = _load_model(args.checkpoint)

    def answer() -> str:
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False
        )
        return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    before = answer()
    with StemEditor(model, [edit]):
        after = answer()
    print(
        f"prompt: {args.prompt!r}\nedit: {args.source!r} -> {args.target!r} (tokens {list(edit.source)} -> "
        f"{list(edit.target)})\nbefore: {before!r}\nafter ({args.strategy}): {after!r}"
    )
    return before, after


def check_writable(output: str) -> None:
    """Raises unless the results file `output` can be written (its folder is created if missing) and an existing one is
    a results file to merge into: checked before the model loads, so that an evaluation is not lost at its end."""
    path = os.path.abspath(output)
    if os.path.isdir(path):
        raise IsADirectoryError(f"--output: {output} is a folder; name a JSON file")
    folder = os.path.dirname(path)
    try:  # os.access says yes to root on a read-only mount or where a parent is a file: write a probe instead
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".stem-hf-probe-"):
            pass
    except OSError as error:
        raise OSError(f"--output: cannot write {output} ({error}); pass --output somewhere writable") from error
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                earlier = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"--output: {output} exists and is not a results file to merge into ({error})") from error
        if not isinstance(earlier, dict):
            raise ValueError(f"--output: {output} exists and is not a results file (a JSON object) to merge into")


def run_eval(args: argparse.Namespace) -> dict:
    from pathlib import Path

    from .accounting import check_local
    from .evaluation import RESULTS_FILE, _merge_into, evaluate, headline_metrics, load_for_eval
    from .model_card import write_model_card

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks: name at least one lm-eval task or group (e.g. stem_offline)")
    local = check_local(args.checkpoint) and os.path.isdir(args.checkpoint)
    output = args.output or (os.path.join(args.checkpoint, RESULTS_FILE) if local else RESULTS_FILE)
    check_writable(output)
    if args.tables_on_device:
        print("stem-hf eval: --tables-on-device is deprecated; use --no-keep-tables-on-cpu", file=sys.stderr)
    keep = args.keep_tables_on_cpu and not args.tables_on_device
    model, tokenizer = load_for_eval(args.checkpoint, args.device, args.dtype, keep_tables_on_cpu=keep)
    results = evaluate(
        model,
        tasks,
        tokenizer,
        batch_size=args.batch_size,
        limit=args.limit,  # a count or a fraction below 1, as `eval_limit` parsed it
        num_fewshot=args.num_fewshot,
        include_path=args.include_path,
    )
    # Printed before the write: a write that fails still leaves the results on the screen.
    for task, metrics in headline_metrics(results).items():
        print(f"{task:24s} " + "  ".join(f"{metric} {value:.4f}" for metric, value in metrics.items()))
    try:  # as `evaluate(output=...)` writes them, with the save id of the weights evaluated
        _merge_into(Path(output), results, getattr(model, "stem_save_id", None))
    except (OSError, ValueError) as error:
        print(json.dumps(results, indent=2))
        raise SystemExit(
            f"stem-hf eval: could not write the results to {output} ({error}); they are printed above as JSON"
        ) from error
    print(f"results: {output}")
    if local and os.path.samefile(os.path.dirname(os.path.abspath(output)), args.checkpoint):
        if getattr(model.config, "model_type", None) == "stem":
            write_model_card(args.checkpoint)  # the card quotes the results next to it
    return results


if __name__ == "__main__":
    main()
