"""Shared pieces of the pipelines tests: one embedding model per test run and a small corpus."""

from __future__ import annotations

import functools
from pathlib import Path

from rag_mspoe.pipelines.embedding import Embedder

# Facts no model knows; each file answers one question below.
CORPUS = {
    "harbour.md": (
        "# Harbour of Vossel\n\nThe harbour of Vossel was dredged in 1787 by the engineer Tilda Marsk.\n"
    ),
    "bakery.txt": "The Orrin bakery sells a blackcurrant loaf called the dusk roll for nine coins.\n",
    "observatory.html": (
        "<html><head><title>Kelder Observatory</title></head><body><h1>Kelder Observatory</h1>"
        "<p>The Kelder Observatory telescope has a mirror of 412 millimetres.</p>"
        "<script>var hidden = 'script text';</script></body></html>"
    ),
    "ferries.jsonl": (
        '{"title": "Ferry Gannet", "text": "The ferry Gannet crosses the Pell Sound in 38 minutes."}\n'
        '{"title": "Ferry Skua", "text": "The ferry Skua was built at the Harrow yard in 1964."}\n'
    ),
}
QUESTIONS = {
    "Who dredged the harbour of Vossel?": "harbour.md",
    "How much does the dusk roll cost at the Orrin bakery?": "bakery.txt",
    "How large is the mirror of the Kelder telescope?": "observatory.html",
    "How long does the Gannet take to cross the Pell Sound?": "ferries.jsonl",
}


@functools.cache
def embedder() -> Embedder:
    """The default all-MiniLM-L6-v2, loaded once for all pipelines tests."""
    return Embedder.load()


def write_corpus(folder: Path, files: dict[str, str] = CORPUS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder
