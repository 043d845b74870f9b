"""No function of the package runs over 120 lines, but for argument parsers (a list of options
reads best in one place): a longer function does more than one job."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rag_mspoe"
MOST_LINES = 120
# A function that declares this many command-line options is an argument parser.
PARSER_OPTIONS = 10


def long_functions(root: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            lines = node.end_lineno - node.lineno + 1 if node.end_lineno else 0
            if lines > MOST_LINES and not is_argument_parser(node):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def is_argument_parser(function: ast.AST) -> bool:
    options = [
        call
        for call in ast.walk(function)
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "add_argument"
    ]
    return len(options) >= PARSER_OPTIONS


def test_no_function_runs_over_the_limit():
    assert not long_functions(), "split these into functions with one job each"


def test_the_check_finds_a_long_function_and_spares_a_parser(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MOST_LINES + 1))
    options = "\n".join(f"    parser.add_argument('--o{i}')" for i in range(MOST_LINES + 1))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n\n\ndef register(parser):\n{options}\n")
    assert long_functions(tmp_path) == [f"{tmp_path.name}/long.py:1 long ({MOST_LINES + 2} lines)"]
