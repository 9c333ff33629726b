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
    """Shell commands, split on `&&`: the lines of bash blocks (continuations joined), and the inline code of table
    rows and of prose that names a concrete folder (not `stem-hf eval` or `stem-hf card DIR` as a reference)."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        lines += block.replace("\\\n", " ").splitlines()
    for line in PROSE.splitlines():
        spans = re.findall(r"`([^`]+)`", line)
        lines += spans if line.startswith("|") else [s for s in spans if "runs/" in s]
    return [part.strip() for line in lines for part in line.split("&&") if part.strip()]


def _words(command: str) -> list[str]:
    return shlex.split(command, comments=True)


STEM_HF = [c for c in _commands() if c.startswith("stem-hf ")]
SCRIPTS = [c for c in _commands() if re.match(r"(\.venv/bin/)?python (benchmarks|notebooks)/", c)]


def test_the_readme_shows_commands():
    assert len(STEM_HF) >= 10 and len(SCRIPTS) >= 8


@pytest.mark.parametrize("command", STEM_HF)
def test_stem_hf_commands_parse(command):
    try:
        build_parser().parse_args(_words(command)[1:])
    except SystemExit as exit:  # `--help` exits 0; a bad command exits 2
        assert exit.code == 0, command


def test_named_files_exist():
    named = set(re.findall(r"\b((?:benchmarks|notebooks|tests|stem_hf|conversion|model_cards)/[\w./-]+\.\w+)", README))
    assert named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing


def test_benchmark_options_exist():
    helps = {}
    for command in SCRIPTS:
        words = _words(command)
        script = words[1]
        options = [w for w in words[2:] if w.startswith("--")]
        if not options or not script.startswith("benchmarks/"):
            continue
        if script not in helps:
            run = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True)
            assert run.returncode == 0, run.stderr
            helps[script] = run.stdout
        assert all(option in helps[script] for option in options), (command, helps[script])
    assert helps


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_section_links_find_their_headings():
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", PROSE, re.M)}
    links = set(re.findall(r"\]\(#([^)]+)\)", README))
    assert links and not links - anchors
