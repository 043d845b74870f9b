"""The same index as a LangChain or LlamaIndex retriever, so users can build their own chains.

    retriever = langchain_retriever("my-index", k=5)
    retriever.invoke("When was the light first lit?")        # list of langchain Documents

    retriever = llamaindex_retriever("my-index", k=5)
    retriever.retrieve("When was the light first lit?")      # list of NodeWithScore

Both return chunks in retrieval order, best first; `first_stage="hybrid"` (or "lexical") adds
BM25 to the embeddings. The libraries are imported only here, so the rest of the pipelines work
without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rag_mspoe.pipelines.embedding import canonical_model_name
from rag_mspoe.pipelines.retrieval import DEFAULT_TOP_K, FirstStage, Retriever

if TYPE_CHECKING:
    from rag_mspoe.connectors.langchain_retriever import LangChainRetriever
    from rag_mspoe.connectors.llamaindex_retriever import LlamaIndexRetriever


def langchain_retriever(
    index: str | Path | Retriever,
    *,
    k: int = DEFAULT_TOP_K,
    embedding_model: str | None = None,
    first_stage: FirstStage | None = None,
) -> LangChainRetriever:
    """A LangChain `BaseRetriever` over an index folder (or an open Retriever); `first_stage`:
    dense, lexical or hybrid (default: an open Retriever's own, else dense)."""
    try:
        from rag_mspoe.connectors.langchain_retriever import LangChainRetriever
    except ImportError as exc:
        raise ImportError(
            f"{exc}. The LangChain retriever needs: pip install 'rag-mspoe[langchain]'"
        ) from exc
    return LangChainRetriever(retriever=_open(index, embedding_model, first_stage), k=k)


def llamaindex_retriever(
    index: str | Path | Retriever,
    *,
    k: int = DEFAULT_TOP_K,
    embedding_model: str | None = None,
    first_stage: FirstStage | None = None,
) -> LlamaIndexRetriever:
    """A LlamaIndex `BaseRetriever` over an index folder (or an open Retriever); `first_stage`:
    dense, lexical or hybrid (default: an open Retriever's own, else dense)."""
    try:
        from rag_mspoe.connectors.llamaindex_retriever import LlamaIndexRetriever
    except ImportError as exc:
        raise ImportError(
            f"{exc}. The LlamaIndex retriever needs: pip install 'rag-mspoe[llamaindex]'"
        ) from exc
    return LlamaIndexRetriever(_open(index, embedding_model, first_stage), k=k)


def _open(
    index: str | Path | Retriever, embedding_model: str | None, first_stage: FirstStage | None
) -> Retriever:
    if isinstance(index, Retriever):
        if embedding_model is not None:
            index.index.check_embedding_model(canonical_model_name(embedding_model))
        if first_stage is None or first_stage == index.first_stage:
            return index
        return Retriever(index.index, index.embedder, first_stage=first_stage)
    return Retriever.load(index, embedding_model=embedding_model, first_stage=first_stage or "dense")
