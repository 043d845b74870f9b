"""The run's index as the LangChain vector store of LangChain's current RAG tutorial, which searches
its store itself (`vector_store.similarity_search(query)`) rather than through a retriever."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore

from rag_mspoe.connectors.langchain_retriever import langchain_documents
from rag_mspoe.pipelines.retrieval import Retriever


class IndexVectorStore(VectorStore):
    """Read-only: the index's top-k chunks as documents, best first, as its retriever ranks them."""

    def __init__(self, retriever: Retriever) -> None:
        self.retriever = retriever

    def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        return langchain_documents(self.retriever.retrieve(query, k))

    def add_texts(self, texts: Iterable[str], metadatas: Any = None, **kwargs: Any) -> list[str]:
        raise NotImplementedError("The run's index is read-only: add documents with `rag-mspoe index`.")

    @classmethod
    def from_texts(cls, texts: list[str], embedding: Embeddings, metadatas: Any = None, **kwargs: Any) -> Any:
        raise NotImplementedError("Open an index folder with IndexVectorStore(Retriever.load(folder)).")
