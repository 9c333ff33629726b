"""Measured figures in the docs cannot drift from the benchmark results.

Every measured figure quoted in README.md, docs/*.md, benchmarks/README.md or model_cards/README.md sits inside a block

    <!-- figures: benchmarks/results/NAME.json[, benchmarks/results/OTHER.json] -->
    ...
    <!-- /figures -->

and equals, as rounded in the text, a value in one of the JSON files the block names. A block whose marker says
`pending` names a JSON file that a benchmark does not write yet: it is skipped while that file is missing, and checked
as any other once it exists. A marker shown as code (in backticks or a fenced block) is no marker.

Inside a block, after fenced code, inline code spans, HTML comments and link targets are removed, every number that
is not part of an identifier is a figure (`SmolLM2`, `STEM-1/3`, `135M`, `1/2`, `p95`, `16k` are not): `50,000`
reads 50000, `1.86e+05` reads in scientific notation, and a trailing `x`, `×` or `%` is allowed. A figure shown with
d decimals matches a JSON value v (any number in the files: values, numeric dict keys, numbers written inside
strings) when |v - figure| is at most half a unit of its last digit; a percentage may also match 100 v; a figure
followed by a unit with a decimal prefix (`5.9 kbit`, `1.51 GB`, `30 KB`) may also match v in base units (powers of
1000 or 1024). Every number in a block must match, so keep config values that are not in the JSON out of blocks.

Outside the blocks, a decimal followed by `x`/`×` (a ratio: `1.48x`) and any percentage fail, so that measured
figures cannot escape the rule; integers and plain decimals (config values, versions such as 5.23) are left alone.

The check is as strong as the JSON is sparse: an integer or a two-decimal figure can match an unrelated value of a
large file. It catches figures that drift after a re-run, not every misquote. Pure Python: no torch.
"""

import bisect
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted(
    [ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "model_cards" / "README.md"]
    + list((ROOT / "docs").glob("*.md"))
)
DOCS = [p for p in DOCS if p.exists()]

OPEN = re.compile(r"<!--\s*figures:(.*?)-->")
CLOSE = re.compile(r"<!--\s*/figures\s*-->")
NUMBER = re.compile(
    r"""
    (?<![\w/.])                 # not inside an identifier, a path or after a decimal point
    (?<![A-Za-z_]-)             # not joined to a word by a hyphen (STEM-1/3; a range 0.98-1.00 still counts)
    (?P<number>
        \d{1,3}(?:,\d{3})+(?:\.\d+)?    # 50,000 and 1,234.5
      | \d+(?:\.\d+)?(?:e[+-]?\d+)?     # 1.48, 29, 1e-3, 1.86e+05
    )
    (?P<suffix>[x×%])?
    (?![\w/]|\.\d)              # not followed by a letter, a digit, a slash or more of a version number
    """,
    re.X,
)


@dataclass
class Figure:
    text: str  # as written, suffix included
    value: float
    tolerance: float  # half a unit of the last digit shown
    percent: bool
    decimal: bool  # written with a decimal point or an exponent
    line: int
    scales: tuple[float, ...] = (1.0,)  # a unit after it ("5.9 kbit", "1.51 GB") may scale it


@dataclass
class Block:
    path: Path
    line: int  # of the opening marker
    names: list[str]
    pending: bool
    figures: list[Figure] = field(default_factory=list)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _blank(match: re.Match) -> str:
    """Replaces a match by spaces, keeping its newlines, so that offsets and line numbers stay put."""
    return re.sub(r"[^\n]", " ", match.group(0))


def _code_blanked(text: str) -> str:
    """`text` with fenced code and inline code spans blanked (a marker shown as code is no marker)."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", _blank, text, flags=re.S | re.M)
    return re.sub(r"`[^`]*`", _blank, text)


def _strip(text: str) -> str:
    """Removes what is not prose: fenced code, inline code spans, HTML comments and link targets."""
    text = re.sub(r"<!--.*?-->", _blank, _code_blanked(text), flags=re.S)
    return re.sub(r"\]\([^)\s]*\)", lambda m: "]" + " " * (len(m.group(0)) - 1), text)


UNIT = re.compile(r" ?([kKMGT])(?:B|iB|bit|bits)?\b")
POWERS = {"k": 1, "K": 1, "M": 2, "G": 3, "T": 4}


def _figure(match: re.Match, line: int, after: str = "") -> Figure:
    written = match.group("number").replace(",", "")
    value = float(written)
    if "e" in written:
        mantissa, exponent = written.split("e")
        decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
        unit = 10.0 ** (int(exponent) - decimals)
    else:
        decimals = len(written.split(".")[1]) if "." in written else 0
        unit = 10.0**-decimals
    prefix = UNIT.match(after) if not match.group("suffix") else None
    power = POWERS[prefix.group(1)] if prefix else 0
    return Figure(
        scales=(1.0, 1000.0**power, 1024.0**power) if power else (1.0,),
        text=match.group(0),
        value=value,
        tolerance=unit / 2 * (1 + 1e-9) + 1e-12,
        percent=match.group("suffix") == "%",
        decimal="." in written or "e" in written,
        line=line,
    )


def _figures(text: str, offset: int, first_line: int) -> list[Figure]:
    """The numbers of `text` (already stripped), with their line numbers; `text` starts at `offset` of a file whose
    line there is `first_line`."""
    found = []
    for match in NUMBER.finditer(text):
        line = first_line + text.count("\n", 0, match.start())
        found.append(_figure(match, line, text[match.end() : match.end() + 6]))
    return found


def parse(path: Path) -> tuple[list[Block], list[str], str]:
    """The figures blocks of a markdown file, the problems of their markers (unclosed, nested, stray closings), and
    the file's prose outside the blocks (stripped, blocks blanked, offsets kept)."""
    raw = path.read_text()
    masked = _code_blanked(raw)  # where markers are looked for; same offsets as raw
    problems = []
    blocks = []
    outside = list(raw)
    position = 0
    while True:
        opening = OPEN.search(masked, position)
        stray = CLOSE.search(masked, position)
        if stray and (not opening or stray.start() < opening.start()):
            problems.append(f"{_rel(path)}:{raw.count(chr(10), 0, stray.start()) + 1}: a /figures with no block open")
            position = stray.end()
            continue
        if not opening:
            break
        line = raw.count("\n", 0, opening.start()) + 1
        closing = CLOSE.search(masked, opening.end())
        nested = OPEN.search(masked, opening.end())
        if not closing:
            problems.append(f"{_rel(path)}:{line}: figures block never closed")
            break
        if nested and nested.start() < closing.start():
            problems.append(f"{_rel(path)}:{line}: figures block opened inside another")
        words = opening.group(1).replace(",", " ").split()
        pending = "pending" in words
        names = [w for w in words if w != "pending"]
        if not names:
            problems.append(f"{_rel(path)}:{line}: figures block names no JSON file")
        body = raw[opening.end() : closing.start()]
        block = Block(path, line, names, pending)
        block.figures = _figures(_strip(body), opening.end(), raw.count("\n", 0, opening.end()) + 1)
        blocks.append(block)
        for i in range(opening.start(), closing.end()):
            if outside[i] != "\n":
                outside[i] = " "
        position = closing.end()
    return blocks, problems, _strip("".join(outside))


def _numbers(node, found: list[float]) -> None:
    """Every number in a JSON document: values, numeric dict keys and numbers written inside strings."""
    if isinstance(node, bool) or node is None:
        return
    if isinstance(node, (int, float)):
        if math.isfinite(node):
            found.append(abs(float(node)))
    elif isinstance(node, str):
        for text in re.findall(r"\d+(?:\.\d+)?(?:e[+-]?\d+)?", node):
            found.append(float(text))
    elif isinstance(node, dict):
        for key, value in node.items():
            _numbers(key, found)
            _numbers(value, found)
    elif isinstance(node, list):
        for value in node:
            _numbers(value, found)


_VALUES: dict[str, list[float]] = {}


def values(name: str) -> list[float]:
    """The sorted numbers of a JSON file under the repository root."""
    if name not in _VALUES:
        found: list[float] = []
        _numbers(json.loads((ROOT / name).read_text()), found)
        _VALUES[name] = sorted(found)
    return _VALUES[name]


def _near(sorted_values: list[float], target: float, tolerance: float) -> bool:
    i = bisect.bisect_left(sorted_values, target - tolerance)
    return i < len(sorted_values) and sorted_values[i] <= target + tolerance


def matches(figure: Figure, sorted_values: list[float]) -> bool:
    if figure.percent:
        return any(_near(sorted_values, figure.value * k, figure.tolerance * k) for k in (1.0, 0.01))
    return any(_near(sorted_values, figure.value * k, figure.tolerance * k) for k in figure.scales)


def _collect():
    blocks, files = [], []
    for path in DOCS:
        found, problems, outside = parse(path)
        blocks += found
        files.append((path, problems, outside))
    return blocks, files


BLOCKS, FILES = _collect()


def test_the_docs_quote_figures_in_blocks():
    assert BLOCKS, "no figures block in any doc"


@pytest.mark.parametrize("path, problems, outside", FILES, ids=[_rel(f[0]) for f in FILES])
def test_figures_blocks_are_well_formed(path, problems, outside):
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path, problems, outside", FILES, ids=[_rel(f[0]) for f in FILES])
def test_no_measured_figure_outside_a_block(path, problems, outside):
    escaped = [
        f"{_rel(path)}:{f.line}: {f.text!r} is a measured figure outside a figures block"
        for f in _figures(outside, 0, 1)
        if f.percent or (f.decimal and f.text[-1] in "x×")
    ]
    assert not escaped, "\n".join(escaped)


@pytest.mark.parametrize(
    "block", BLOCKS, ids=[f"{_rel(b.path)}:{b.line}:{','.join(Path(n).stem for n in b.names)}" for b in BLOCKS]
)
def test_figures_equal_their_json(block):
    where = f"{_rel(block.path)}:{block.line}"
    missing = [name for name in block.names if not (ROOT / name).is_file()]
    if missing and block.pending:
        pytest.skip(f"{where}: pending results, {', '.join(missing)} not written yet")
    assert not missing, f"{where}: figures block names {', '.join(missing)}, which does not exist"
    assert block.figures, f"{where}: figures block quotes no figure"
    sorted_values = sorted(v for name in block.names for v in values(name))
    wrong = [
        f"{_rel(block.path)}:{f.line}: {f.text!r} is in no value of {', '.join(block.names)}"
        for f in block.figures
        if not matches(f, sorted_values)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_edit_strategies_tables_hold_each_value_in_its_place():
    """The knowledge lab's tables of edit strategies and injection, rebuilt row by row from their JSON as
    `benchmarks/edit_strategies.py --markdown` prints them: each figure at its place, not only somewhere in the file."""
    result = json.loads((ROOT / "benchmarks" / "results" / "edit_strategies.json").read_text())
    doc = (ROOT / "docs" / "knowledge_lab.md").read_text()
    f = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    rows = []
    for group, e in result["edits"].items():
        for method, m in e["methods"].items():
            keys = ("efficacy", "generalization", "divergence_closed", "locality", "locality_shared_name_token")
            rows.append([f"{group.replace('_', ' ')} ({e['pairs']})", method, *(f(m[k]) for k in keys)])
    for key, r in result["injection"].items():
        keys = ("recall_train", "recall_heldout", "before_train", "own_kept", "others_kept", "sharers_kept")
        rows.append([*key.replace("_", " ").split("/"), str(r["people"]), *(f(r[k]) for k in keys)])
    missing = [line for line in ("| " + " | ".join(row) + " |" for row in rows) if line not in doc]
    assert not missing, "\n".join(["rows of the JSON not in docs/knowledge_lab.md:", *missing])
