"""The package's layers, read from its source (ast): what each module may import.

    0 core          twinattn.core.*, twinattn._version and the native modules: NumPy, ml_dtypes
                    and the standard library only
    1 Python layer  twinattn.nn.*, and the public face over core and nn: twinattn (__init__) and
                    twinattn.reference
    2 integrations  twinattn.torch, twinattn.flash, twinattn.hf (and twinattn.hf_serving),
                    twinattn.distributed, twinattn.models
    3 tools         twinattn.bench.*, twinattn.__main__

A module imports from its own layer or below, never above; nothing below the integrations imports
torch or transformers (layers 0 and 1 nowhere, the tools not at module level); and no modules
import each other in a cycle, lazy imports inside functions and TYPE_CHECKING blocks included.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Optional

import pytest

import twinattn

PACKAGE = Path(twinattn.__file__).resolve().parent
LAYER_NAMES = ("core", "Python layer", "integrations", "tools")
# the native modules (and the types of their stubs) and the version: leaves, beside twinattn.core
NATIVE_AND_VERSION = ("twinattn._cpp", "twinattn._rust", "twinattn._native_types", "twinattn._version")
INTEGRATIONS = (
    "twinattn._torch_views", "twinattn.torch", "twinattn.flash", "twinattn.hf", "twinattn.hf_serving", "twinattn.distributed",
    "twinattn.models",
)
OPTIONAL_HEAVY = ("torch", "transformers")
# what layers 0 and 1 may import besides the standard library and twinattn itself
CORE_THIRD_PARTY = ("numpy", "ml_dtypes", "typing_extensions")


def layer_of(module: str) -> Optional[int]:
    """The layer of a twinattn module, None for one this test does not know (a new module must be
    given its place here)."""
    if module in NATIVE_AND_VERSION or _within(module, "twinattn.core"):
        return 0
    if module in ("twinattn", "twinattn.reference") or _within(module, "twinattn.nn"):
        return 1
    if module in INTEGRATIONS:
        return 2
    if module == "twinattn.__main__" or _within(module, "twinattn.bench"):
        return 3
    return None


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _module_name(path: Path) -> str:
    parts = ("twinattn",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@lru_cache(maxsize=None)
def modules() -> dict[str, Path]:
    """Every module of the package: its .py files, and the native modules by their stubs."""
    found = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in path.parts}
    found.update({_module_name(path): path for path in sorted(PACKAGE.glob("_[a-z]*.pyi"))})
    return found


def _is_package(module: str) -> bool:
    return modules()[module].name == "__init__.py"


def _absolute(module: str, imported: Optional[str], level: int) -> str:
    """The absolute name of `from <level dots><imported> import ...` written in `module`."""
    if level == 0:
        assert imported is not None
        return imported
    base = module.split(".")
    base = base if _is_package(module) else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([imported] if imported else []))


def _module_level(tree: ast.Module) -> Iterator[ast.AST]:
    """The nodes that run when the module is imported: everything outside function bodies."""
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield node
        pending.extend(ast.iter_child_nodes(node))


def imports(module: str, *, module_level_only: bool = False) -> list[tuple[str, int]]:
    """(imported module, line) for every import in `module`: a name imported from a package is the
    submodule it names when there is one, else the package."""
    tree = ast.parse(modules()[module].read_text(encoding="utf-8"))
    nodes = _module_level(tree) if module_level_only else ast.walk(tree)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node.module, node.level)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.append((submodule if submodule in modules() else source, node.lineno))
    return found


def _top(name: str) -> str:
    return name.split(".")[0]


def _is_stdlib(name: str) -> bool:
    names = getattr(sys, "stdlib_module_names", None)  # Python >= 3.10
    if names is not None:
        return name in names or name == "__future__"
    if name in sys.builtin_module_names:
        return True
    spec = importlib.util.find_spec(name)
    origin = "" if spec is None or spec.origin is None else os.path.realpath(spec.origin)
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    return origin.startswith(stdlib) and "site-packages" not in origin and "dist-packages" not in origin


def test_every_module_has_a_layer() -> None:
    assert "twinattn.core.api" in modules() and "twinattn.bench.cli" in modules()  # the source was found
    unknown = [module for module in modules() if layer_of(module) is None]
    assert not unknown, f"modules without a layer (give each one its place in layer_of): {unknown}"


@pytest.mark.parametrize("module", sorted(modules()))
def test_imports_come_from_the_same_layer_or_below(module: str) -> None:
    own = layer_of(module)
    assert own is not None
    upward = [
        f"line {line}: {imported} ({LAYER_NAMES[layer]})"
        for imported, line in imports(module)
        if imported in modules() and (layer := layer_of(imported)) is not None and layer > own
    ]
    assert not upward, f"{module} ({LAYER_NAMES[own]}) imports from a higher layer: {upward}"


@pytest.mark.parametrize("module", sorted(m for m in modules() if (layer_of(m) or 0) <= 1))
def test_core_and_python_layer_import_numpy_and_the_standard_library_only(module: str) -> None:
    foreign = [
        f"line {line}: {imported}"
        for imported, line in imports(module)
        if _top(imported) != "twinattn" and _top(imported) not in CORE_THIRD_PARTY and not _is_stdlib(_top(imported))
    ]
    assert not foreign, f"{module} imports beyond NumPy, ml_dtypes and the standard library: {foreign}"


@pytest.mark.parametrize("module", sorted(m for m in modules() if m not in INTEGRATIONS))
def test_nothing_outside_the_integrations_imports_torch_or_transformers_when_imported(module: str) -> None:
    below = (layer_of(module) or 0) < 2
    heavy = [
        f"line {line}: {imported}"
        for imported, line in imports(module, module_level_only=not below)
        if _top(imported) in OPTIONAL_HEAVY
    ]
    where = "anywhere" if below else "at module level"
    assert not heavy, f"{module} imports torch or transformers {where}: {heavy}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or one importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def import_graph() -> dict[str, set[str]]:
    return {module: {imported for imported, _ in imports(module) if imported in modules()} for module in modules()}


def test_no_import_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check itself
    assert _cycles({"a": {"b"}, "b": set()}) == []
    graph = import_graph()
    assert "twinattn.core.reference" in graph["twinattn.core.api"]  # the graph holds what the source says
    assert not _cycles(graph), f"modules that import each other (move the shared piece down a layer): {_cycles(graph)}"


@pytest.mark.parametrize(
    "module, names",
    [
        ("twinattn.reference", ["attention", "attention_reference", "round_to_dtype"]),
        ("twinattn.nn", ["Attention"]),
        ("twinattn.bench", ["main"]),
        ("twinattn.bench.kv_quality", ["main"]),
    ],
)
def test_public_module_names_import(module: str, names: list[str]) -> None:
    imported = importlib.import_module(module)
    assert all(callable(getattr(imported, name)) for name in names), [n for n in names if not hasattr(imported, n)]
