"""RAG pipelines: read documents, chunk, embed, index in FAISS, retrieve, pack in retrieval order,
answer with citations.

    from rag_mspoe.pipelines import index_documents, Retriever, answer_question
    from rag_mspoe.engine import Engine

    index_documents("docs/", "my-index")
    answer = answer_question("When was the light first lit?", Retriever.load("my-index"), Engine.load())
    print(answer.text, [(c.number, c.source) for c in answer.citations])

FAISS, sentence-transformers, LangChain and LlamaIndex are imported only when used. The LangChain
and LlamaIndex retrievers live with the other adapters, in `rag_mspoe.connectors.retrievers`.
"""

from rag_mspoe.pipelines.answer import Answer, Citation, answer_question, generate_answer, parse_citations
from rag_mspoe.pipelines.chunking import Chunk, chunk_documents
from rag_mspoe.pipelines.embedding import DEFAULT_EMBEDDING_MODEL, Embedder
from rag_mspoe.pipelines.index import ChunkIndex, IndexMismatchError, IndexNotFoundError, IndexSettings
from rag_mspoe.pipelines.indexing import IndexReport, index_documents
from rag_mspoe.pipelines.ingest import Document, load_documents
from rag_mspoe.pipelines.packing import PackedPrompt, pack, render_prompt
from rag_mspoe.pipelines.retrieval import RetrievedChunk, Retriever
from rag_mspoe.prompts.document_order import long_context_reorder

__all__ = [
    "DEFAULT_EMBEDDING_MODEL",
    "Answer",
    "Chunk",
    "ChunkIndex",
    "Citation",
    "Document",
    "Embedder",
    "IndexMismatchError",
    "IndexNotFoundError",
    "IndexReport",
    "IndexSettings",
    "PackedPrompt",
    "RetrievedChunk",
    "Retriever",
    "answer_question",
    "chunk_documents",
    "generate_answer",
    "index_documents",
    "load_documents",
    "long_context_reorder",
    "pack",
    "parse_citations",
    "render_prompt",
]
