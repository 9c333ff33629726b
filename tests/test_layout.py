"""The house rules that keep the project easy to carry on, checked on the source: no import circle and no import up to a
command line; remote code that imports only what transformers' own model files import; short functions; a pretrained
class that is flags and thin delegates; test files that share helpers through tests/conftest.py, never by importing one
another."""

import ast
import functools
import re
from pathlib import Path

import pytest
import transformers

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "stem_hf"
REMOTE_CODE = ("checkpoint_stem.py", "compat_stem.py", "configuration_stem.py", "modeling_stem.py")
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str) -> set[str]:
    """The stem_hf modules `name` imports, at module level or inside functions."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = f"{base}.{node.module}" if node.level and node.module else (node.module or base)
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def test_no_module_imports_itself_back():
    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in GRAPH[node]:
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    cycles = [cycle for name in MODULES if (cycle := cycle_from(name))]
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_library_never_imports_a_command_line():
    clis = {name for name in MODULES if name.endswith(".cli")}
    importers = {name: GRAPH[name] & clis for name in MODULES if name not in clis and GRAPH[name] & clis}
    assert not importers, importers
    # Command lines import downward only: stem_hf.cli hands each subcommand to its package's cli.
    assert not {c: GRAPH[c] & clis for c in clis if c != "stem_hf.cli" and GRAPH[c] & clis}


def test_only_the_lab_and_the_command_line_import_the_lab():
    # stem_hf.lab is research code (the knowledge lab, the paper's claims): the model, checkpoint, training and
    # conversion code never lean on it.
    def in_lab(name: str) -> bool:
        return name == "stem_hf.lab" or name.startswith("stem_hf.lab.")

    outside = {name for name in MODULES if not in_lab(name) and name != "stem_hf.cli"}
    importers = {name: sorted(filter(in_lab, GRAPH[name])) for name in outside if any(map(in_lab, GRAPH[name]))}
    assert not importers, importers


@functools.cache
def _model_file_imports() -> frozenset[tuple[str, str]]:
    """(module, name) pairs that transformers' own model and config files import, as absolute module names (parsed
    once: several hundred files)."""
    pairs = set()
    models = Path(transformers.__file__).parent / "models"
    for path in [*models.glob("*/modeling_*.py"), *models.glob("*/configuration_*.py")]:
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ImportFrom) and node.level >= 2 and node.module:
                module = "transformers." + node.module if node.level == 3 else None
                if module:
                    pairs.update((module, alias.name) for alias in node.names)
    return frozenset(pairs)


@pytest.mark.parametrize("file", REMOTE_CODE)
@pytest.mark.slow
def test_remote_code_imports_only_what_transformers_model_files_do(file):
    allowed = _model_file_imports()
    tree = ast.parse((PACKAGE / file).read_text())
    for node in tree.body:  # module level only: names imported inside a function fail there, with a clear error
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
            assert all(n.split(".")[0] in ("torch", "transformers") or n.split(".")[0] in STDLIB for n in names), names
        elif isinstance(node, ast.ImportFrom) and node.level:
            assert node.level == 1 and f"{node.module}.py" in REMOTE_CODE, (
                f"{file}: from {'.' * node.level}{node.module}"
            )
        elif isinstance(node, ast.ImportFrom) and node.module.startswith("transformers"):
            for alias in node.names:
                assert not alias.name.startswith("_"), f"{file}: private {node.module}.{alias.name}"
                if node.module != "transformers":
                    assert (node.module, alias.name) in allowed, f"{file}: {node.module}.{alias.name}"
        elif isinstance(node, ast.ImportFrom):
            assert node.module.split(".")[0] in ("torch", *STDLIB), f"{file}: from {node.module}"


STDLIB = (
    "collections",
    "concurrent",
    "contextlib",
    "contextvars",
    "ctypes",
    "dataclasses",
    "functools",
    "importlib",
    "inspect",
    "json",
    "math",
    "mmap",
    "os",
    "platform",
    "re",
    "secrets",
    "shutil",
    "struct",
    "sys",
    "time",
    "typing",
    "uuid",
    "warnings",
)

# The transformers names remote code loads where it uses them (`checkpoint_stem._transformers_name`), none of which
# transformers' own model files import: each is a dependency on transformers' internals that docs/model.md names.
DYNAMIC_TRANSFORMERS_NAMES = {
    ("transformers.utils.hub", "convert_file_size_to_int"),
    ("transformers.integrations.accelerate", "_get_device_map"),
    ("transformers.integrations.accelerate", "check_and_set_device_map"),
}


def _dynamic_names(file: str) -> set[tuple[str, str]]:
    """(module, name) of every transformers name `file` loads by name, through importlib or `_transformers_name`."""
    found, tree = set(), ast.parse((PACKAGE / file).read_text())
    loader = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_transformers_name"]
    inside_loader = {id(n) for f in loader for n in ast.walk(f)}  # the one place that imports a name it is given
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or id(node) in inside_loader:
            continue
        called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        if called in ("_transformers_name", "import_module", "__import__"):
            args = [a.value if isinstance(a, ast.Constant) else None for a in node.args]
            assert args and isinstance(args[0], str), f"{file}:{node.lineno}: a name loaded from a computed module"
            if args[0].startswith("transformers"):
                assert len(args) == 2 and isinstance(args[1], str), f"{file}:{node.lineno}: {called}({args})"
                found.add((args[0], args[1]))
    return found


def test_remote_code_loads_by_name_only_the_declared_transformers_names_and_each_exists():
    """The house rule on private transformers names sees the names loaded at run time too: a new one fails here until
    it is declared above (and in docs/model.md), and a release that drops one fails `make check-newest`."""
    import importlib

    loaded = set().union(*(_dynamic_names(file) for file in REMOTE_CODE))
    assert loaded == DYNAMIC_TRANSFORMERS_NAMES
    for module, name in loaded:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name} is gone from this transformers"


def _functions():
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{path.relative_to(ROOT)}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1


def test_no_function_is_longer_than_a_screen_or_two():
    long = sorted(((n, where) for where, n in _functions() if n > MAX_FUNCTION_LINES), reverse=True)
    assert not long, long


def test_the_pretrained_class_is_flags_and_thin_delegates():
    tree = ast.parse((PACKAGE / "modeling_stem.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StemPreTrainedModel")
    assert cls.end_lineno - cls.lineno + 1 <= 60
    for method in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
        assert method.end_lineno - method.lineno + 1 <= 12, method.name


def test_the_supported_transformers_range_is_declared_once_for_installs_and_once_for_checkpoints(tmp_path):
    import json

    from stem_hf.configuration_stem import SUPPORTED_TRANSFORMERS, StemConfig

    setup = (ROOT / "setup.cfg").read_text()
    assert re.search(rf"^\s*transformers{re.escape(SUPPORTED_TRANSFORMERS)}$", setup, re.M)
    StemConfig(num_hidden_layers=2).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["supported_transformers"] == SUPPORTED_TRANSFORMERS
    oldest = re.search(r"^OLDEST_TRANSFORMERS := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert SUPPORTED_TRANSFORMERS.startswith(f">={oldest.removesuffix('.0')},")  # CI tests the lower bound


@pytest.mark.parametrize("module, extra", [("lm_eval", "eval"), ("matplotlib", "demo"), ("peft", "peft")])
def test_a_missing_optional_dependency_names_its_extra(monkeypatch, module, extra):
    import sys

    from stem_hf.extras import require

    monkeypatch.setitem(sys.modules, module, None)  # what an environment without it gives an import
    with pytest.raises(ImportError, match=rf"pip install 'stem-hf\[{extra}\]'"):
        require(module)


def test_no_test_file_imports_another_test_file():
    # Tests are filed by unit; what two files share lives in tests/conftest.py (tests/fake_hub.py for the loopback
    # Hub), so that moving or deleting a test file never breaks another one.
    found = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):  # also `from tests import test_x` and `from .test_x import y`
                names = [node.module or ""] + [f"{node.module or ''}.{alias.name}".lstrip(".") for alias in node.names]
            else:
                continue
            if any(re.fullmatch(r"(tests\.)?test_\w+(\..+)?", name) for name in names):
                found.append(f"tests/{path.name}:{node.lineno}")
    assert not found, f"imports of a test file (move the helper to tests/conftest.py): {found}"
