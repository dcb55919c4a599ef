"""The layering flows → tasks → focus_core: the library imports no orchestration, tracking or infrastructure, so it
runs in a notebook or another trainer without Prefect, MLflow or this repo's stages; and no two of its modules
import each other, directly or through others."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

FORBIDDEN = ("prefect", "mlflow", "tasks", "flows", "infra", "prefect_dask", "dask")

SCRIPT = """
import importlib, json, pkgutil, sys
import focus_core
names = [m.name for m in pkgutil.walk_packages(focus_core.__path__, "focus_core.")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"modules": names, "loaded": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def test_importing_all_of_focus_core_loads_no_orchestration_tracking_or_infra():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report["modules"]) > 20  # the walk found the library
    assert not set(FORBIDDEN) & set(report["loaded"]), set(FORBIDDEN) & set(report["loaded"])


def import_graph(root: Path, *packages: str) -> dict[str, set[str]]:
    """Module name -> the packages' modules it imports at run time, at module level or inside a function (read with
    ``ast``, nothing is imported). Imports under ``if TYPE_CHECKING:`` run for type checkers only and are left out.
    ``from a import b`` counts as an import of module ``a.b`` when there is one, else of ``a``."""
    files = {}
    for path in (path for package in packages for path in (root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]  # the importing package
        tree = ast.parse(path.read_text(), str(path))
        type_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                     for statement in block.body for node in ast.walk(statement)}
        imported = set()
        for node in ast.walk(tree):
            if id(node) in type_only:
                continue
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                anchor = here[: len(here) - node.level + 1] if node.level else []  # ``from .. import x``
                base = ".".join([*anchor, node.module] if node.module else anchor)
                for alias in node.names:
                    imported.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base)
        graph[name] = {module for module in imported if module in files and module != name}
    return graph


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import one another (strongly connected components of two or more), sorted."""
    order: dict[str, int] = {}  # Tarjan's algorithm: visit order, lowest order reachable, the open stack
    lowest: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        order[module] = lowest[module] = len(order)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in order:
                visit(target)
                lowest[module] = min(lowest[module], lowest[target])
            elif target in stack:
                lowest[module] = min(lowest[module], order[target])
        if lowest[module] == order[module]:  # ``module`` roots a component: pop it
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return sorted(cycles)


def test_the_cycle_check_sees_function_level_and_relative_imports_and_not_type_checking_ones(tmp_path):
    package = tmp_path / "p"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("import p.b\n")
    (package / "b.py").write_text("def late():\n    from .c import thing\n")
    (package / "c.py").write_text("from p import a\nthing = 1\n")
    (package / "d.py").write_text("from typing import TYPE_CHECKING\nfrom p.a import x\nif TYPE_CHECKING:\n"
                                  "    from p import e\n")
    (package / "e.py").write_text("import p.d\n")
    graph = import_graph(tmp_path, "p")
    assert graph == {"p": set(), "p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}, "p.e": {"p.d"}}
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"]]


@pytest.mark.parametrize("packages", [("focus_core",), ("focus_core", "tasks", "flows", "bench", "infra", "examples")],
                         ids=["focus_core", "the project"])
def test_no_module_imports_itself_through_others(packages):
    graph = import_graph(REPO, *packages)
    assert len(graph) > 20 and "focus_core.policy.base" in graph["focus_core.agent.harness"]
    cycles = import_cycles(graph)
    assert not cycles, "import cycles (each: modules that import one another): " + "; ".join(
        " <-> ".join(cycle) for cycle in cycles)
