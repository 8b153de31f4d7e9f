"""No import cycle among gym_fork's modules, lazy (function-level) imports included: a
lazy import that only breaks a cycle at import time still ties the two modules into
one, and hides the real layering (docs/architecture.md: imports go one way)."""

from __future__ import annotations

import ast
from pathlib import Path

import gym_fork

ROOT = Path(gym_fork.__file__).resolve().parent

# Imports (importer, imported) left out of the graph on purpose, each with its reason.
ALLOWED: dict[tuple[str, str], str] = {}


def module_names() -> dict[str, Path | None]:
    """Every gym_fork module and the file it comes from (None: compiled, no imports)."""
    names: dict[str, Path | None] = {}
    for path in ROOT.rglob("*.so"):
        relative = path.relative_to(ROOT.parent)
        names[".".join([*relative.parent.parts, path.name.split(".")[0]])] = None
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Ids of the nodes under ``if TYPE_CHECKING:`` (never run)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped.update(id(n) for n in ast.walk(child))
    return skipped


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The gym_fork modules ``name`` imports anywhere in its file."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skipped = _type_checking_only(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            # A bare ``import gym_fork`` in gym_fork.x.y (for ``__file__``) is no edge:
            # a package is initialised before any of its modules runs.
            targets = [a.name for a in node.names if not name.startswith(f"{a.name}.")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.add(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {
        name: imports_of(name, path, set(modules)) if path else set()
        for name, path in modules.items()
    }


def test_the_graph_sees_lazy_imports():
    graph = import_graph()
    # make_host imports each backend inside the function: those are edges too.
    assert "gym_fork.hosts.process.host" in graph["gym_fork.hosts"]
    assert "gym_fork.hosts.base" in graph["gym_fork.hosts.process.host"]


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset({"a", "b", "c"})]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_gym_fork_modules():
    graph = import_graph()
    for importer, imported in ALLOWED:
        graph[importer].discard(imported)
    found = [sorted(c) for c in cycles(graph)]
    assert not found, f"import cycles (a lazy import counts): {found}"
