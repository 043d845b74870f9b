"""Type-check the package under the names users import it by.

pyproject.toml maps the top-level folders connectors/, pipelines/ and eval/ into
rag_mspoe.connectors, rag_mspoe.pipelines and rag_mspoe.eval. mypy names a module after the
folders it sits in, so run on the folders it would check a package called `eval` and find no
`rag_mspoe.eval` at all. This lays the files out as the installed package (symbolic links, built
from the package-dir table itself, so it never drifts), checks that tree, and prints the messages
with the paths of the real files.

Then it proves the imports across the mapping resolve: a snippet that imports one name from each
mapped package must reveal real types, never `Any`.

    python .ci/typecheck.py              # what the README test command runs
    python .ci/typecheck.py -- --strict  # extra arguments go to mypy
"""

from __future__ import annotations

import os
import shutil
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / ".mypy_cache" / "package-tree"

# One name per mapped package: importing it must give mypy the real class, not Any.
CANARIES = {
    "rag_mspoe.engine": "Engine",
    "rag_mspoe.tools.tool_calls": "ToolCall",
    "rag_mspoe.connectors.server_models": "ModelRoutes",
    "rag_mspoe.pipelines.index": "ChunkIndex",
    "rag_mspoe.eval.runs.loop": "Evaluation",
}


def package_dirs() -> dict[str, Path]:
    """Each package name and the folder it is installed from (pyproject's package-dir)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    table: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    return {package: ROOT / folder for package, folder in table.items()}


def build_tree(tree: Path = TREE) -> dict[Path, Path]:
    """The installed layout as links under `tree`; returns each tree folder and the real one it shows.
    (The documentation build reads the package from such a tree too: mkdocs_hooks.py.)"""
    shutil.rmtree(tree, ignore_errors=True)
    shown: dict[Path, Path] = {}
    # Parents first, so that a mapped subpackage gets its own folder inside its parent's.
    for package, folder in sorted(package_dirs().items()):
        target = tree.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        shown[target] = folder
        for entry in folder.iterdir():
            if entry.name != "__pycache__" and not (target / entry.name).exists():
                (target / entry.name).symlink_to(entry)
    return shown


def real_paths(text: str, shown: dict[Path, Path]) -> str:
    """mypy's messages with tree paths replaced by the real files' paths (deepest folders first)."""
    folders = sorted(shown.items(), key=lambda item: -len(str(item[0])))
    lines = []
    for line in text.splitlines(keepends=True):
        for tree_folder, folder in folders:
            shown_as = f"{tree_folder.relative_to(TREE)}/"
            if line.startswith(shown_as):
                line = f"{folder.relative_to(ROOT)}/{line.removeprefix(shown_as)}"
                break
        lines.append(line)
    return "".join(lines)


def mypy(*args: str) -> tuple[str, str, int]:
    """mypy run inside the tree (so that it finds the package there), with the project's settings."""
    # Imported here: the documentation build uses this module's tree without mypy installed.
    from mypy import api

    return api.run(
        ["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(ROOT / ".mypy_cache"), *args]
    )


def check_canaries() -> list[str]:
    """Names of the canaries mypy does not see as their real class."""
    snippet = "".join(
        f"from {module} import {name}\nreveal_type({name})\n" for module, name in CANARIES.items()
    )
    out, _, _ = mypy("--no-error-summary", "-c", snippet)
    revealed = [line for line in out.splitlines() if "Revealed type" in line]
    return [
        f"{module}.{name}"
        for (module, name), line in zip(CANARIES.items(), revealed, strict=False)
        if f"{module}.{name}" not in line
    ] + [f"{module}.{name}" for module, name in list(CANARIES.items())[len(revealed) :]]


def main(argv: list[str]) -> int:
    shown = build_tree()
    os.chdir(TREE)
    out, err, status = mypy(*argv, "-p", "rag_mspoe")
    sys.stdout.write(real_paths(out, shown))
    sys.stderr.write(err)
    if status:
        return status
    blind = check_canaries()
    if blind:
        print(f"mypy does not see the real types of {blind}: their imports resolve to Any.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(args[1:] if args[:1] == ["--"] else args))
