"""PINE, position-invariant inference (Wang et al., ICLR 2025): the method's config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from rag_mspoe.attention.pine_hooks import PineHooks
from rag_mspoe.method_config import MethodConfig


@dataclass
class Pine(MethodConfig):
    """Make the model's output independent of the order of the documents.

    In every layer and head: (1) documents attend to each other in both directions (causally
    inside a document); the text before the documents is unchanged, the text after them reads
    everything; (2) for each query, the documents take new positions by a position-free
    importance score (softmax of q.k without RoPE, averaged over the document's tokens): the
    more important, the closer to the query; a query inside a document treats its own document
    as the last one. The documents' region keeps its place and length.
    Tokens between two documents (separators) count as part of the document before them.
    Needs full attention in every layer (no sliding windows).
    """

    kind: ClassVar[str] = "pine"
    hooks: ClassVar[type[PineHooks]] = PineHooks
    presets: ClassVar[dict[str, dict[str, Any]]] = {"pine": {}}

    def needs_document_spans(self) -> bool:
        return True
