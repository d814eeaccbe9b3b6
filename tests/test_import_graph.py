"""bcg's module-level import graph (TYPE_CHECKING blocks excluded): no cycles, and data
flows one way, so nothing the model is built from imports the runner or the engine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "bcg"
# Importer prefix -> prefixes it must never import.
FORBIDDEN = {
    "bcg.layers": ("bcg.runner", "bcg.engine", "bcg.server"),
    "bcg.models": ("bcg.runner", "bcg.engine", "bcg.server"),
    "bcg.kernels": ("bcg.runner", "bcg.engine", "bcg.server", "bcg.layers", "bcg.models"),
    "bcg.graph": ("bcg.",),
    "bcg.forward": ("bcg.",),
    "bcg.utils": ("bcg.",),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_level_imports(tree: ast.Module) -> set[str]:
    """What a module imports when it is loaded: its top-level statements (and those in
    try/if blocks), not function bodies, not TYPE_CHECKING blocks."""
    found: set[str] = set()
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "bcg imports absolutely"
            base = node.module
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.If) and not is_type_checking(node):
            pending += node.body + node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + node.orelse + node.finalbody
            for handler in node.handlers:
                pending += handler.body
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE_ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        imported = module_level_imports(ast.parse(path.read_text()))
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A list of modules that import each other in a ring, or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after

    def visit(path: list[str]) -> list[str] | None:
        state[path[-1]] = "open"
        for target in sorted(graph[path[-1]]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(path + [target])):
                return cycle
        state[path[-1]] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit([start])):
            return cycle
    return None


def test_the_graph_sees_real_imports():
    graph = import_graph()
    assert "bcg.forward" in graph["bcg.runner.model_runner"]
    assert "bcg.graph" in graph["bcg.layers.step_op"]
    assert "bcg.runner.model_runner" in graph["bcg.runner.graph_verify"]


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("importer", sorted(FORBIDDEN))
def test_data_flows_one_way(importer):
    bad = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if module == importer or module.startswith(importer + ".")
        for target in targets
        if any(target.startswith(prefix) for prefix in FORBIDDEN[importer])
        and not target.startswith(importer)
    )
    assert not bad, "; ".join(bad)


def test_a_cycle_is_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
