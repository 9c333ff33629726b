"""The docs cannot drift from the code: in README.md, docs/*.md, benchmarks/README.md and model_cards/README.md every
`stem-hf` command shown parses, every file named exists, every option passed to a benchmark script is one the script
takes, and every relative link finds its file (and, with `#anchor`, a heading there)."""

import re
import shlex
from pathlib import Path

import pytest

from stem_hf.cli import build_parser
from tests.conftest import parse_benchmark_runs

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted(
    [ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "model_cards" / "README.md"]
    + list((ROOT / "docs").glob("*.md"))
)
DOCS = [p for p in DOCS if p.exists()]
TEXT = {p: p.read_text() for p in DOCS}
IDS = [str(p.relative_to(ROOT)) for p in DOCS]
# A figures block whose results are still to come names a JSON file that does not exist yet (tests/test_doc_figures.py).
PENDING = re.compile(r"<!--\s*figures:[^>]*\bpending\s*-->")


def _prose(text: str) -> str:
    """The text without its code blocks."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def _cells(row: str) -> list[str]:
    """The cells of a markdown table row (escaped pipes `\\|` stay in their cell)."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def _table_commands(prose: str) -> list[str]:
    """Inline code in the command column of a table: the column headed `try it` or `command`."""
    commands, column = [], None
    for line in prose.splitlines():
        if not line.startswith("|"):
            column = None
            continue
        cells = _cells(line)
        if column is None:  # a header row
            heads = [cell.lower() for cell in cells]
            column = next((i for i, head in enumerate(heads) if head in ("try it", "command")), -1)
        elif column >= 0 and column < len(cells) and not re.fullmatch(r":?-+:?", cells[column]):
            commands += re.findall(r"`([^`]+)`", cells[column])
    return commands


def _commands(text: str) -> list[str]:
    """Shell commands, split on `&&`: the lines of bash blocks (continuations joined), and inline code that is a
    command: in the command column of a table (`try it`, `command`), and outside tables, naming a `runs/` folder,
    running a benchmark or notebook script, or a `stem-hf` subcommand with arguments (`stem-hf eval` alone names the
    command, it does not run it)."""
    prose = _prose(text)
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines += block.replace("\\\n", " ").splitlines()
    lines += _table_commands(prose)
    running = "\n".join(line for line in prose.splitlines() if not line.startswith("|"))  # tables: commands above
    for span in re.findall(r"`([^`]+)`", running):  # inline code may wrap over lines
        span = " ".join(span.split())
        if "runs/" in span or re.match(r"(make demo && )?(\.venv/bin/)?python (benchmarks|notebooks)/", span):
            lines.append(span)
        elif re.match(r"stem-hf \S+ \S", span):
            lines.append(span)
    return [part.strip() for line in lines for part in line.split("&&") if part.strip()]


def _words(command: str) -> list[str]:
    return shlex.split(command, comments=True)


def _is_stem_hf(command: str) -> bool:
    return command.startswith("stem-hf ")


def _is_script(command: str) -> bool:
    return bool(re.match(r"(\.venv/bin/)?python (benchmarks|notebooks)/", command))


COMMANDS = {p: _commands(t) for p, t in TEXT.items()}
STEM_HF = [c for p in DOCS for c in COMMANDS[p] if _is_stem_hf(c)]
SCRIPTS = [c for p in DOCS for c in COMMANDS[p] if _is_script(c)]


def test_the_docs_show_commands():
    assert len(STEM_HF) >= 10 and len(SCRIPTS) >= 8
    assert any(_is_stem_hf(c) for c in COMMANDS[ROOT / "README.md"]), "README.md shows no stem-hf command"


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
    where = [str(p.relative_to(ROOT)) for p in DOCS if command in COMMANDS[p]]
    try:
        _strict_parser().parse_args(_words(command)[1:])
    except SystemExit as exit:  # `--help` exits 0; a bad command exits 2
        assert exit.code == 0, (where, command)


def _written_by_a_script(name: str) -> bool:
    """A result file under benchmarks/results/ that a benchmark script writes (its file name is in the script): it
    exists once the script has run."""
    if not name.startswith("benchmarks/results/"):
        return False
    scripts = [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "benchmarks").glob("*.sh")]
    return any(Path(name).name in script.read_text() for script in scripts)


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_named_files_exist(path):
    text = PENDING.sub("", TEXT[path])
    named = set(re.findall(r"\b((?:benchmarks|notebooks|tests|stem_hf|conversion|model_cards)/[\w./-]+\.\w+)", text))
    missing = sorted(p for p in named if not (ROOT / p).exists() and not _written_by_a_script(p))
    assert not missing, (str(path.relative_to(ROOT)), missing)


def test_the_docs_name_files():
    assert any(
        re.search(r"\b(?:benchmarks|notebooks|tests|stem_hf|conversion|model_cards)/[\w./-]+\.\w+", t)
        for t in TEXT.values()
    )


def _benchmark_runs() -> list[tuple[str, tuple[str, ...]]]:
    """Each distinct benchmark command line with arguments, as (script, arguments)."""
    runs = []
    for command in SCRIPTS:
        words = _words(command)
        script, arguments = words[1], tuple(words[2:])
        if script.startswith("benchmarks/") and arguments and (script, arguments) not in runs:
            runs.append((script, arguments))
    return runs


BENCHMARK_RUNS = _benchmark_runs()


def test_the_docs_pass_options_to_benchmarks():
    assert BENCHMARK_RUNS


@pytest.fixture(scope="module")
def parsed_benchmark_runs() -> dict[tuple[str, tuple[str, ...]], tuple[int, str]]:
    """Every benchmark command line of the docs parsed by its script (`parse_benchmark_runs`): exit status, stderr."""

    runs = [[script, list(arguments)] for script, arguments in BENCHMARK_RUNS]
    return {run: tuple(result) for run, result in zip(BENCHMARK_RUNS, parse_benchmark_runs(runs), strict=True)}


@pytest.mark.parametrize("script, arguments", BENCHMARK_RUNS, ids=[" ".join((s, *a)) for s, a in BENCHMARK_RUNS])
@pytest.mark.slow
def test_benchmark_commands_parse(script, arguments, parsed_benchmark_runs):
    """The command line, read by the script's own parser: its option names, choice and typed values."""
    code, stderr = parsed_benchmark_runs[script, arguments]
    assert code == 0, (script, arguments, stderr)


def test_a_bad_benchmark_command_line_fails_to_parse():
    """What `test_benchmark_commands_parse` relies on: a wrong option or value is an exit status 2 with argparse's
    message, where `--help` would have exited 0."""

    runs = [["benchmarks/bench_gpu.py", ["--no-such-option"]], ["benchmarks/bench_gpu.py", ["--skip", "nothing"]],
            ["benchmarks/bench_scale.py", ["--quick", "--no-such-option"]],
            ["benchmarks/profile_gpu.py", ["--only", "no_such_variant"]],
            ["benchmarks/bench_gpu.py", ["--skip", "decode"]], ["benchmarks/bench_scale.py", ["--quick"]]]  # fmt: skip
    results = parse_benchmark_runs(runs)
    (option, option_err), (value, value_err), (known, known_err), (variant, variant_err), *good = results
    assert option == 2 and "unrecognized arguments: --no-such-option" in option_err
    assert value == 2 and "argument --skip: must be among" in value_err
    assert known == 2 and "unrecognized arguments: --no-such-option" in known_err  # a parse_known_args script
    assert variant == 2 and "argument --only: must be among" in variant_err
    assert [code for code, _ in good] == [0, 0]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", _prose(path.read_text()), re.M)}


def _links(text: str) -> list[str]:
    """Targets of markdown links and images outside code: `](target)`, without a title."""
    prose = re.sub(r"`[^`]*`", "", _prose(text))
    return [t.split()[0] for t in re.findall(r"\]\(([^)]+)\)", prose) if t.split()]


def test_the_docs_link_to_sections():
    assert any("#" in t and not t.startswith("http") for p in DOCS for t in _links(TEXT[p]))


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_relative_links_resolve(path):
    """A relative link names a file that exists; with `#anchor`, a heading of that file (or of this one) has it."""
    broken = []
    for target in _links(TEXT[path]):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor} in {linked.relative_to(ROOT)}")
    assert not broken, (str(path.relative_to(ROOT)), broken)
