"""The index as a LangChain retriever (needs `langchain-core`: pip install 'rag-mspoe[langchain]')."""

from __future__ import annotations

from collections.abc import Iterable

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field

from rag_mspoe.pipelines.retrieval import DEFAULT_TOP_K, RetrievedChunk, Retriever


class LangChainRetriever(BaseRetriever):
    """Top-k chunks as LangChain documents, best first; metadata holds source, title, offsets and score.

    `k` is set on the retriever and may be changed per call: `retriever.invoke(query, k=3)`.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    retriever: Retriever
    k: int = Field(default=DEFAULT_TOP_K, ge=1)

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int | None = None
    ) -> list[Document]:
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"k must be a positive whole number of documents, got {k!r}.")
        return langchain_documents(self.retriever.retrieve(query, self.k if k is None else k))


def langchain_documents(hits: Iterable[RetrievedChunk]) -> list[Document]:
    """Retrieved chunks as LangChain documents: metadata holds source, title, offsets and score."""
    return [Document(id=hit.uid, page_content=hit.chunk.text, metadata=hit.metadata()) for hit in hits]
