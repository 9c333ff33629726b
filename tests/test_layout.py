"""The house rules that keep the project easy to carry on, checked on the source: no import circle and no import up to a
command line; remote code that imports only what transformers' own model files import; short functions; a pretrained
class that is flags and thin delegates."""

import ast
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


def _model_file_imports() -> set[tuple[str, str]]:
    """(module, name) pairs that transformers' own model and config files import, as absolute module names."""
    pairs = set()
    models = Path(transformers.__file__).parent / "models"
    for path in [*models.glob("*/modeling_*.py"), *models.glob("*/configuration_*.py")]:
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ImportFrom) and node.level >= 2 and node.module:
                module = "transformers." + node.module if node.level == 3 else None
                if module:
                    pairs.update((module, alias.name) for alias in node.names)
    return pairs


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
