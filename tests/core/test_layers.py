"""The packages of labkit are layers by the process they run in, and imports only run downward.

    cli, labkit/__init__, __main__        (6)  above all
    ui, study                             (5)  the notebook's widgets; studies made of runs (neither imports the other)
    launch                                (4)  the parent side of a run
    rank                                  (3)  what runs inside a rank
    models                                (2)  what a rank trains
    core                                  (1)  what the parent and the ranks share: config, DeepSpeed config, schema
    runtime                               (0)  the machine: devices, DeepSpeed's import and ops, build locks

A module may import its own package and any package of a lower layer, never one above nor beside it (ui and study
are beside each other). Every import counts, the ones inside functions too; only those under `if TYPE_CHECKING:`
(never run) do not. And no two modules import each other, directly or round a loop.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"runtime": 0, "core": 1, "models": 2, "rank": 3, "launch": 4, "ui": 5, "study": 5, "": 6}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """The layer's key of a labkit module: `labkit.rank.worker` -> "rank"; cli, __main__ and labkit itself -> ""."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else ""


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"))


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The labkit modules `path` imports at run time (module level and inside functions)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_only(node):
            for child in getattr(node, "orelse", []):
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("labkit"))
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            if node.module and node.module.startswith("labkit"):
                for alias in node.names:  # `from labkit.core import memory` imports a module
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in modules else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in sorted((ROOT / "labkit").rglob("*.py"))}
    return {module: imports_of(path, set(paths)) - {module} for module, path in paths.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, imported in graph.items():
        mine = package_of(module)
        for other in sorted(imported):
            theirs = package_of(other)
            if theirs != mine and LAYERS[theirs] >= LAYERS[mine]:
                bad.append(f"{module} imports {other} ({theirs or 'top'} is not below {mine or 'top'})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in graph:
                continue
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_every_package_has_a_layer():
    packages = {package_of(module) for module in import_graph()}
    assert packages <= set(LAYERS), packages - set(LAYERS)


def test_no_import_runs_upward_or_sideways():
    assert upward_imports(import_graph()) == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_checks_catch_an_upward_import_and_a_cycle():
    graph = {"labkit.rank.worker": {"labkit.study.noise_scale"}, "labkit.study.noise_scale": set(),
             "labkit.study.growth": {"labkit.study.report"}, "labkit.study.report": {"labkit.study.growth"},
             "labkit.ui.panel": {"labkit.study.lessons"}, "labkit.study.lessons": set(),
             "labkit.cli": {"labkit.ui.panel"}}
    assert upward_imports(graph) == [
        "labkit.rank.worker imports labkit.study.noise_scale (study is not below rank)",
        "labkit.ui.panel imports labkit.study.lessons (study is not below ui)"]
    assert cycles(graph) == [["labkit.study.growth", "labkit.study.report"]]


def test_imports_inside_functions_count_and_type_checking_ones_do_not(tmp_path, monkeypatch):
    source = tmp_path / "labkit" / "rank" / "x.py"
    source.parent.mkdir(parents=True)
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from labkit.launch.run import Run\n"
                      "def f():\n    from labkit.study import sweep\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert imports_of(source, {"labkit.study.sweep"}) == {"labkit.study.sweep"}


@pytest.mark.slow  # a python subprocess
@pytest.mark.parametrize("entry", ["labkit.rank.worker", "labkit.rank.guard", "labkit.rank.entry"])
def test_a_ranks_entry_point_loads_nothing_of_launch_ui_or_study(entry):
    code = (f"import sys, {entry}\n"
            "print(sorted(m for m in sys.modules if m.startswith(('labkit.launch', 'labkit.ui', 'labkit.study'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
