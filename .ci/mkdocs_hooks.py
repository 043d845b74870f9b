"""mkdocs hook: lay the package out as it is installed before mkdocstrings reads it.

connectors/, pipelines/ and eval/ are installed as rag_mspoe.connectors, .pipelines and .eval
(pyproject's package-dir), so the API reference reads the package from a tree of links in that
layout (the one .ci/typecheck.py checks), not from the checkout's folders.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from typecheck import ROOT, build_tree  # noqa: E402

TREE = ROOT / "build" / "docs-package-tree"


def on_startup(**_: Any) -> None:
    build_tree(TREE)
