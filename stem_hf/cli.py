"""The `stem-hf` command."""

import argparse
import json


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="stem-hf", description="STEM models for Hugging Face Transformers")
    commands = parser.add_subparsers(dest="command", required=True)

    info = commands.add_parser("info", help="parameter counts and FLOPs per token of a STEM checkpoint vs dense")
    info.add_argument("checkpoint", help="a STEM checkpoint folder or Hub id (only its config is read)")
    info.add_argument("--context-length", type=int, default=2048, help="positions each token attends to")

    demo = commands.add_parser("demo", help="a small end-to-end example")
    demo.add_argument("--out", default="runs/demo", help="where to save the demo checkpoint")

    args = parser.parse_args(argv)
    if args.command == "info":
        from .accounting import load_config, summarize

        print(json.dumps(summarize(load_config(args.checkpoint), args.context_length), indent=2))
    elif args.command == "demo":
        from .demo import run_demo

        run_demo(args.out)


if __name__ == "__main__":
    main()
