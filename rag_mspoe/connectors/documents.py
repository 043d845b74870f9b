"""Retrieved documents as prompt text that says where each one is.

    chain = {"context": retriever | format_documents, "question": RunnablePassthrough()} | prompt | llm

`format_documents` writes one `Document [i](Title: ...) text` line per document, in the order
given (the packer's and the lost-in-the-middle benchmark's layout). The engine finds those lines
in any message, so methods that read documents (`pine`, `attention-calibration`) work through a
LangChain or LlamaIndex chain, or an HTTP client, with no other change.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rag_mspoe.prompts.qa_prompt import format_document


def format_documents(documents: Iterable[Any]) -> str:
    """One numbered line per document, in the order given.

    Takes LangChain `Document`s (title from metadata "title", else "source"), LlamaIndex nodes
    (`NodeWithScore`, `TextNode`), this package's retrieved chunks, (title, text) pairs or strings.
    """
    lines = [
        format_document(number, *_title_and_text(item)) for number, item in enumerate(documents, start=1)
    ]
    return "\n".join(lines)


def _title_and_text(item: Any) -> tuple[str, str]:
    if isinstance(item, str):
        return "", item
    if isinstance(item, tuple) and len(item) == 2 and all(isinstance(part, str) for part in item):
        return item[0], item[1]
    chunk = getattr(item, "chunk", None)  # rag_mspoe.pipelines.retrieval.RetrievedChunk
    if chunk is not None and hasattr(chunk, "title"):
        return str(chunk.title), str(chunk.text)
    node = getattr(item, "node", item)  # LlamaIndex: NodeWithScore wraps a node
    metadata = getattr(node, "metadata", None) or {}
    title = str(metadata.get("title") or metadata.get("source") or metadata.get("file_name") or "")
    if hasattr(node, "page_content"):  # LangChain Document
        return title, str(node.page_content)
    if hasattr(node, "get_content"):
        return title, str(node.get_content())
    raise TypeError(
        f"format_documents takes documents, nodes, retrieved chunks, (title, text) pairs or strings; "
        f"got {type(item).__name__}."
    )
