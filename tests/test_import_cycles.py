"""The package's modules import each other without cycles.

Imports at module level, inside functions and under `if TYPE_CHECKING:` all count: an import
inside a function closes a cycle as surely, only later, and a type-only one ties the modules
together for every reader of the code. The layers contract in pyproject.toml (`lint-imports`)
keeps the package's parts in order, but the core's parts use one another as siblings; this test
holds all modules, theirs included, to no cycle. The graph is grimp's, the one `lint-imports` reads.
"""

from __future__ import annotations

import itertools
from collections import deque

import grimp

Graph = dict[str, dict[str, int]]  # module -> {module it imports: line of the first such import}


def import_graph(package: str) -> Graph:
    imports = grimp.build_graph(package, exclude_type_checking_imports=False, cache_dir=None)
    graph: Graph = {}
    for module in imports.modules:
        graph[module] = {
            target: min(
                d["line_number"] for d in imports.get_import_details(importer=module, imported=target)
            )
            for target in imports.find_modules_directly_imported_by(module)
        }
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
    graph = import_graph("rag_mspoe")
    # Imports inside functions and for the type checker are read too.
    assert "rag_mspoe.eval.runs.manifest" in graph["rag_mspoe.eval.runs.ray_backend"]  # in Worker
    assert "rag_mspoe.engine.protocol" in graph["rag_mspoe.methods.prompt_rewriting"]  # TYPE_CHECKING
    cycles = [describe(cycle, graph) for cycle in find_cycles(graph)]
    assert not cycles, (
        "Import cycles among the package's modules:\n  "
        + "\n  ".join(cycles)
        + "\nMove what both sides need into a module of their own (or each piece where it belongs); "
        "an import moved inside a function or under TYPE_CHECKING still closes the cycle."
    )


def test_a_cycle_through_an_import_inside_a_function_is_found_and_named(tmp_path, monkeypatch):
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "import os\nfrom pkg.sub import b\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import d\n",
        "pkg/d.py": "import os\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": "def late():\n    from .. import a\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.syspath_prepend(tmp_path)

    graph = import_graph("pkg")

    assert graph["pkg.sub.b"] == {"pkg.a": 2}  # a relative import, inside a function
    assert graph["pkg.c"] == {"pkg.d": 3}  # for the type checker only
    [cycle] = find_cycles(graph)
    assert describe(cycle, graph) == "pkg.a -> pkg.sub.b (line 2) -> pkg.a (line 2)"
