"""The package's own modules import each other without cycles.

Every `import` and `from ... import` statement of every module is read with `ast`, at module
level and inside functions alike (an import inside a function closes a cycle as surely, only
later). Imports under `if TYPE_CHECKING:` never run and are left out.
"""

from __future__ import annotations

import ast
import itertools
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

Graph = dict[str, dict[str, int]]  # module -> {module it imports: line of the first such import}


def package_modules(package: Path) -> dict[str, Path]:
    """Each module of the package in the folder `package`: its dotted name and its file."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _running_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of a module, at any depth, but for those only a type checker reads."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        pending.extend(ast.iter_child_nodes(node))
    return found


def _imported_names(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """Dotted names an import statement may load: `from a import b` loads a.b if it is a module."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: counted up from the importing module's package
        anchor = package.rsplit(".", node.level - 1)[0]
        base = f"{anchor}.{base}" if base else anchor
    return [f"{base}.{alias.name}" for alias in node.names]


def _owning_module(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is one of our modules (None: another package)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(package: Path) -> Graph:
    modules = package_modules(package)
    graph: Graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = graph[module] = {}
        for node in sorted(_running_imports(ast.parse(path.read_text(), str(path))), key=lambda n: n.lineno):
            for name in _imported_names(node, package):
                target = _owning_module(name, modules)
                if target is not None and target != module:
                    edges.setdefault(target, node.lineno)
    return graph


def _shortest_cycle(graph: Graph, start: str) -> list[str]:
    """start -> ... -> start by the fewest imports (start must lie on a cycle)."""
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        module = queue.popleft()
        for target in sorted(graph[module]):
            if target in came_from:
                continue
            came_from[target] = module
            if target == start:
                path = [start]
                while path[-1] != start or len(path) == 1:
                    path.append(came_from[path[-1]])
                return path[::-1]
            queue.append(target)
    raise AssertionError(f"{start} lies on no cycle")


def _reachable(graph: Graph, start: str) -> set[str]:
    seen: set[str] = set()
    pending = list(graph[start])
    while pending:
        module = pending.pop()
        if module not in seen:
            seen.add(module)
            pending.extend(graph[module])
    return seen


def find_cycles(graph: Graph) -> list[list[str]]:
    """One shortest cycle through each group of modules that import one another, directly or not."""
    reach = {module: _reachable(graph, module) for module in graph}
    grouped: set[str] = set()
    cycles = []
    for module in sorted(graph):
        if module in grouped or module not in reach[module]:
            continue
        grouped |= {other for other in reach[module] if module in reach[other]}
        cycles.append(_shortest_cycle(graph, module))
    return cycles


def describe(cycle: list[str], graph: Graph) -> str:
    """'a -> b (line 12) -> a (line 40)': each arrow's line is in the module before it."""
    steps = [f"{target} (line {graph[source][target]})" for source, target in itertools.pairwise(cycle)]
    return " -> ".join([cycle[0], *steps])


def test_the_package_imports_without_cycles():
    graph = import_graph(ROOT / "rag_mspoe")
    # Function-level imports count too.
    assert "rag_mspoe.eval.runs.ray_backend" in graph["rag_mspoe.eval.runs.loop"]
    assert "rag_mspoe.eval.runs.manifest" in graph["rag_mspoe.eval.runs.ray_backend"]  # in Worker
    cycles = [describe(cycle, graph) for cycle in find_cycles(graph)]
    assert not cycles, (
        "Import cycles among the package's modules:\n  "
        + "\n  ".join(cycles)
        + "\nMove what both sides need into a module of their own (or each piece where it belongs); "
        "an import moved inside a function still closes the cycle."
    )


def test_a_cycle_through_an_import_inside_a_function_is_found_and_named(tmp_path):
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "import os\nfrom pkg.sub import b\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import d\n",
        "pkg/d.py": "import pkg.c\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": "def late():\n    from .. import a\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    graph = import_graph(tmp_path / "pkg")

    assert graph["pkg.sub.b"] == {"pkg.a": 2}  # a relative import, inside a function
    assert graph["pkg.c"] == {}  # for the type checker only
    [cycle] = find_cycles(graph)
    assert describe(cycle, graph) == "pkg.a -> pkg.sub.b (line 2) -> pkg.a (line 2)"
