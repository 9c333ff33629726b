"""Converts a dense Llama-family checkpoint (Llama, Mistral, Qwen2, Qwen3: a folder, a Hub id or a .gguf file) to STEM.

    python conversion/convert_llama_to_stem.py SOURCE OUT [--stem-layers 1/3] [--init fitted] [--heal-tokens N] ...

The options are `stem-hf convert`'s (`--help` lists them); the steps are `stem_hf.conversion.convert`'s.
"""

import argparse
import sys

from stem_hf.conversion.cli import add_parsers, run


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="convert_llama_to_stem.py")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["convert", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    main()
