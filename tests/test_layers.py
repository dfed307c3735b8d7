"""The layer rule: imports point one way, and no module imports itself back.

The package is layered (DESIGN.md, "Layers")::

    integrations -> tools -> cluster -> tiers -> reference -> serving -> engine -> errors
                                   \\-> wire ------------------------------^    \\
                                                                                policies

``errors`` is ``prefixcache.errors``; ``policies`` (``prefixcache.policies``)
imports only itself. A layer may import the layers below it, never above or
beside: wire sits beside tiers, reference and serving, which do not know it
(cluster and above import all of them); reference sits below tiers because
the tiered replay reads request traces (``reference/trace.py``). The
package's own top-level modules (``prefixcache/__init__.py``, ``__main__``,
``_moved``) sit above everything.
Imports are read with :mod:`ast` from the source of every module, at module
level and inside functions, ``TYPE_CHECKING`` blocks included (a type-only
import of an upper layer is still knowledge of it); cycles are looked for in
the imports that run (``TYPE_CHECKING`` blocks left out). A fresh
interpreter then imports every module, so an import that only works in
some order shows up too.

``prefixcache._moved`` maps the flat layout's module names to the new ones;
every old name must import, warn, and be the very module of its new name.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from prefixcache import _moved

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"prefixcache": ROOT / "prefixcache", "prefixcache.policies": ROOT / "policies"}
"""Package name -> folder: ``policies/`` installs as ``prefixcache.policies``."""

MAY_IMPORT = {
    "errors": set(),
    "policies": {"policies"},
    "engine": {"engine", "errors", "policies"},
    "serving": {"serving", "engine", "errors", "policies"},
    "reference": {"reference", "serving", "engine", "errors", "policies"},
    "wire": {"wire", "engine", "errors", "policies"},
    "tiers": {"tiers", "reference", "serving", "engine", "errors", "policies"},
    "cluster": {"cluster", "tiers", "reference", "serving", "wire", "engine", "errors", "policies"},
    "tools": {
        "tools",
        "cluster",
        "tiers",
        "reference",
        "serving",
        "wire",
        "engine",
        "errors",
        "policies",
    },
    "integrations": {
        "integrations",
        "tools",
        "cluster",
        "tiers",
        "reference",
        "serving",
        "wire",
        "engine",
        "errors",
        "policies",
    },
}
"""Layer -> the layers its modules may import. The package's top-level modules may import all."""


@dataclass(frozen=True)
class Import:
    """One import statement's target, as the importing module's source states it."""

    source: str
    target: str
    line: int
    in_function: bool
    type_checking: bool

    def __str__(self) -> str:
        where = "in a function" if self.in_function else "module level"
        kind = ", TYPE_CHECKING" if self.type_checking else ""
        return f"{self.source} imports {self.target} (line {self.line}, {where}{kind})"


def module_files() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    modules = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


MODULES = module_files()


def layer_of(module: str) -> str:
    """The layer a module belongs to; ``package`` for the package's own top-level modules."""
    if module == "prefixcache.errors":
        return "errors"
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in MAY_IMPORT:
        return parts[1]
    return "package"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module ``from ... import`` names, relative imports resolved."""
    if node.level == 0:
        return node.module or ""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def imports_of(module: str) -> list[Import]:
    """Every import of a ``prefixcache`` module that ``module``'s source makes."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"), str(MODULES[module]))
    found: list[Import] = []

    def add(target: str, node: ast.stmt, in_function: bool, type_checking: bool) -> None:
        if target == "prefixcache" or target.startswith("prefixcache."):
            found.append(Import(module, target, node.lineno, in_function, type_checking))

    def visit(node: ast.AST, in_function: bool, type_checking: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, in_function, type_checking)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                add(submodule if submodule in MODULES else base, node, in_function, type_checking)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, in_function, True)
            for child in node.orelse:
                visit(child, in_function, type_checking)
            return
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for child in ast.iter_child_nodes(node):
            visit(child, inside, type_checking)

    visit(tree, False, False)
    return found


ALL_IMPORTS = [found for module in MODULES for found in imports_of(module)]


# ---------------------------------------------------------------------- the reader itself


def test_the_package_is_found_with_its_layers() -> None:
    layers = {layer_of(module) for module in MODULES}
    assert set(MAY_IMPORT) | {"package"} <= layers
    assert "prefixcache.engine.allocator" in MODULES and "prefixcache.policies.lru" in MODULES


def test_the_reader_sees_every_kind_of_import() -> None:
    seen = {(found.in_function, found.type_checking) for found in ALL_IMPORTS}
    assert {(False, False), (True, False), (False, True)} <= seen
    tools = {found.target for found in ALL_IMPORTS if found.source == "prefixcache.tools.replay"}
    assert "prefixcache.reference.sim" in tools  # "from prefixcache.reference import sim as loop"


# ---------------------------------------------------------------------- the rule


def _violations(imports: list[Import]) -> list[str]:
    wrong = []
    for found in imports:
        source, target = layer_of(found.source), layer_of(found.target)
        if source != "package" and target not in MAY_IMPORT[source]:
            wrong.append(f"{found}: {source} may not import {target}")
    return wrong


def test_imports_point_down_the_layers() -> None:
    wrong = _violations(ALL_IMPORTS)
    assert not wrong, "\n".join(wrong)


def test_the_rule_catches_an_upward_import() -> None:
    upward = [
        Import("prefixcache.engine.pool", "prefixcache.reference.sim", 1, True, False),
        Import("prefixcache.reference.sim", "prefixcache.wire.metrics", 1, False, True),
        Import("prefixcache.policies.lru", "prefixcache.errors", 1, False, False),
        Import("prefixcache.engine.pool", "prefixcache", 1, False, False),
    ]
    assert len(_violations(upward)) == len(upward)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or with a self-loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(edges.get(node, ())):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return found


def test_no_import_cycles() -> None:
    edges: dict[str, set[str]] = {}
    for found in ALL_IMPORTS:
        if not found.type_checking and found.target in MODULES:
            edges.setdefault(found.source, set()).add(found.target)
    cycles = _cycles(edges)
    assert not cycles, "\n".join(" <-> ".join(cycle) for cycle in cycles)


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"a"}}) == [["a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# ---------------------------------------------------------------------- a fresh interpreter

_FRESH_IMPORTS = """
import importlib, json, sys, traceback, warnings
names, moved = json.loads(sys.argv[1]), json.loads(sys.argv[2])
modules = {}
for name in names:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing == "prefixcache":
            modules[name] = "error: " + traceback.format_exc(limit=-3)
        else:
            modules[name] = "optional: " + missing
    except Exception:
        modules[name] = "error: " + traceback.format_exc(limit=-3)
    else:
        modules[name] = "ok"
old_names = {}
for old, new in moved.items():
    module = sys.modules.get(new)
    if module is None:
        old_names[old] = {"optional": modules.get(new, "not imported")}
        continue
    spec = module.__spec__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alias = importlib.import_module(old)
    old_names[old] = {
        "same": alias is module,
        "warnings": [str(w.message) for w in caught if w.category is DeprecationWarning],
        "spec_kept": module.__spec__ is spec,
    }
print(json.dumps({"modules": modules, "old_names": old_names}))
"""

IMPORTED = sorted(name for name in MODULES if not name.endswith("__main__"))
"""The modules the fresh interpreter imports (a ``__main__`` module runs when imported)."""


@pytest.fixture(scope="module")
def fresh() -> dict[str, dict[str, object]]:
    """A fresh interpreter imports every module, then every old flat name (first time: warns)."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _FRESH_IMPORTS,
            json.dumps(IMPORTED),
            json.dumps(_moved.MOVED_MODULES),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    results: dict[str, dict[str, object]] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


def test_every_module_imports_in_a_fresh_interpreter(fresh: dict[str, dict[str, object]]) -> None:
    results = fresh["modules"]
    assert set(results) == set(IMPORTED)
    errors = {name: str(result) for name, result in results.items() if str(result) != "ok"}
    optional = {name: result for name, result in errors.items() if result.startswith("optional")}
    failed = {name: result for name, result in errors.items() if name not in optional}
    assert not failed, "\n".join(f"{name}: {result}" for name, result in failed.items())
    assert len(optional) <= len(results) // 4, optional  # a few optional extras, not the package


# ---------------------------------------------------------------------- the old flat names


@pytest.mark.parametrize(("old", "new"), sorted(_moved.MOVED_MODULES.items()))
def test_an_old_module_name_imports_warns_and_is_the_new_module(
    old: str, new: str, fresh: dict[str, dict[str, object]]
) -> None:
    result = fresh["old_names"][old]
    assert isinstance(result, dict)
    if "optional" in result:
        pytest.skip(f"{new}: {result['optional']}")
    assert result["same"] is True
    messages = result["warnings"]
    assert isinstance(messages, list)
    assert any(old in message and new in message for message in messages), messages


def test_importing_an_old_name_leaves_the_new_module_spec_alone(
    fresh: dict[str, dict[str, object]],
) -> None:
    old_names = fresh["old_names"]
    changed = sorted(
        old
        for old, result in old_names.items()
        if isinstance(result, dict) and result.get("spec_kept") is False
    )
    assert not changed, f"these imports replaced the new module's __spec__: {changed}"


def test_every_old_name_points_at_a_module_that_exists() -> None:
    assert set(_moved.MOVED_MODULES.values()) <= set(MODULES)
    assert not set(_moved.MOVED_MODULES) & set(MODULES)  # an old name is no module any more
