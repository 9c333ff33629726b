"""The `stem-hf` command."""

import argparse
import json


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="stem-hf", description="STEM models for Hugging Face Transformers")
    commands = parser.add_subparsers(dest="command", required=True)

    info = commands.add_parser("info", help="parameter counts and FLOPs per token of a STEM checkpoint vs dense")
    info.add_argument("checkpoint", help="a STEM checkpoint folder or Hub id (only its config is read)")
    info.add_argument("--context-length", type=int, default=2048, help="positions each token attends to")

    demo = commands.add_parser("demo", help="convert SmolLM2-135M (or --source) to STEM, reload it, compare with dense")
    demo.add_argument("--out", default="runs/demo", help="where to save the converted checkpoint")
    demo.add_argument("--source", default=None, help="a dense checkpoint (default: the embedded SmolLM2-135M GGUF)")
    demo.add_argument("--calibration-tokens", type=int, default=50_000)
    demo.add_argument("--heal-tokens", type=int, default=30_000, help="healing budget (0: none)")
    demo.add_argument("--tiny", action="store_true", help="the one-second example on a random tiny model instead")

    convert = commands.add_parser("convert", help="convert a dense Llama/Mistral/Qwen2/Qwen3 checkpoint to STEM")
    convert.add_argument("source", help="a checkpoint folder, a Hub id, or a .gguf file")
    convert.add_argument("out", help="the folder to write the STEM checkpoint to")
    convert.add_argument("--stem-layers", default="1/3", help='"1/3", "1/2", "full", "1/N" or "1,4,7"')
    convert.add_argument("--init", default="fitted", choices=["fitted", "mean", "projected", "xavier"])
    convert.add_argument("--calibration", nargs="*", default=None, help="text files (default: the bundled corpus)")
    convert.add_argument("--heldout", nargs="*", default=None, help="text files (default: the bundled held-out set)")
    convert.add_argument("--calibration-tokens", type=int, default=150_000)
    convert.add_argument("--heldout-tokens", type=int, default=20_000)
    convert.add_argument(
        "--table-dtype", default="bfloat16", choices=["bfloat16", "bf16", "float16", "fp16", "float32", "fp32"]
    )
    convert.add_argument("--heal-tokens", type=int, default=0, help="distil dense into STEM on N tokens")
    # Left unset, the healing options take `conversion.heal.heal`'s defaults.
    convert.add_argument("--heal-train", choices=("tables", "ffn", "all"), help="what healing trains (default: all)")
    convert.add_argument("--heal-anneal", type=float, help="share of the healing steps that blend W_up out")
    convert.add_argument("--heal-table-lr", type=float, help="learning rate of the table rows")
    convert.add_argument("--heal-lr", type=float, help="learning rate of the other trained weights")
    convert.add_argument("--device", default=None, help="where healing runs, e.g. cuda (default: cpu)")

    args = parser.parse_args(argv)
    if args.command == "info":
        from .accounting import load_config, summarize

        print(json.dumps(summarize(load_config(args.checkpoint), args.context_length), indent=2))
    elif args.command == "demo" and args.tiny:
        from .demo import run_demo

        run_demo(args.out)
    elif args.command == "demo":
        from conversion.demo import run_demo

        run_demo(args.out, args.source, args.calibration_tokens, args.heal_tokens)
    elif args.command == "convert":
        from conversion.cli import run_convert

        run_convert(args)


if __name__ == "__main__":
    main()
