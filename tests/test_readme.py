"""The README cannot drift from the code: every `stem-hf` command it shows parses, every file it names exists, every
option it passes to a benchmark script is one the script takes, and every link to a section finds its heading."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from stem_hf.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PROSE = re.sub(r"```.*?```", "", README, flags=re.S)  # the README without its code blocks


def _commands() -> list[str]:
    """Shell commands, split on `&&`: the lines of bash blocks (continuations joined), and inline code that is a
    command: in a table row, naming a `runs/` folder, running a benchmark or notebook script, or a `stem-hf`
    subcommand with arguments (`stem-hf eval` alone names the command, it does not run it)."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        lines += block.replace("\\\n", " ").splitlines()
    for line in PROSE.splitlines():
        if line.startswith("|"):
            lines += re.findall(r"`([^`]+)`", line)
    for span in re.findall(r"`([^`]+)`", PROSE):  # inline code may wrap over lines
        span = " ".join(span.split())
        if "runs/" in span or re.match(r"(make demo && )?(\.venv/bin/)?python (benchmarks|notebooks)/", span):
            lines.append(span)
        elif re.match(r"stem-hf \S+ \S", span):
            lines.append(span)
    return [part.strip() for line in lines for part in line.split("&&") if part.strip()]


def _words(command: str) -> list[str]:
    return shlex.split(command, comments=True)


STEM_HF = [c for c in _commands() if c.startswith("stem-hf ")]
SCRIPTS = [c for c in _commands() if re.match(r"(\.venv/bin/)?python (benchmarks|notebooks)/", c)]


def test_the_readme_shows_commands():
    assert len(STEM_HF) >= 10 and len(SCRIPTS) >= 8


def _strict_parser():
    """The CLI's parser without option abbreviations, so that a renamed option does not parse as a prefix."""
    parser = build_parser()
    parser.allow_abbrev = False
    for action in parser._subparsers._group_actions:
        for subparser in action.choices.values():
            subparser.allow_abbrev = False
    return parser


@pytest.mark.parametrize("command", sorted(set(STEM_HF)))
def test_stem_hf_commands_parse(command):
    try:
        _strict_parser().parse_args(_words(command)[1:])
    except SystemExit as exit:  # `--help` exits 0; a bad command exits 2
        assert exit.code == 0, command


def test_named_files_exist():
    named = set(re.findall(r"\b((?:benchmarks|notebooks|tests|stem_hf|conversion|model_cards)/[\w./-]+\.\w+)", README))
    assert named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing


def test_benchmark_commands_parse():
    """Each distinct benchmark command line, run with `--help` appended: argparse checks its option names and choice
    values as it reads them, then prints the help and exits 0."""
    checked = set()
    for command in SCRIPTS:
        words = _words(command)
        script, arguments = words[1], words[2:]
        if not script.startswith("benchmarks/") or not arguments or (script, *arguments) in checked:
            continue
        checked.add((script, *arguments))
        run = subprocess.run([sys.executable, script, *arguments, "--help"], cwd=ROOT, capture_output=True, text=True)
        assert run.returncode == 0, (command, run.stderr)
    assert checked


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_section_links_find_their_headings():
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", PROSE, re.M)}
    links = set(re.findall(r"\]\(#([^)]+)\)", README))
    assert links and not links - anchors
