"""The index as a LangChain and a LlamaIndex retriever: same chunks, same order, sources in metadata."""

from __future__ import annotations

import pytest
from pipelines_helpers import embedder, write_corpus

from rag_mspoe.pipelines import langchain_retriever, llamaindex_retriever
from rag_mspoe.pipelines.index import ChunkIndex
from rag_mspoe.pipelines.indexing import index_documents
from rag_mspoe.pipelines.retrieval import Retriever

QUESTION = "How long does the Gannet take to cross the Pell Sound?"


@pytest.fixture(scope="module")
def retriever(tmp_path_factory):
    folder = tmp_path_factory.mktemp("retrievers")
    index_documents(write_corpus(folder / "docs"), folder / "index", embedder=embedder(), progress=False)
    return Retriever(ChunkIndex.load(folder / "index"), embedder())


def test_langchain_retriever_returns_the_chunks_in_retrieval_order(retriever):
    pytest.importorskip("langchain_core")
    from langchain_core.retrievers import BaseRetriever

    lc = langchain_retriever(retriever, k=3)
    assert isinstance(lc, BaseRetriever)
    documents = lc.invoke(QUESTION)
    expected = retriever.retrieve(QUESTION, 3)
    assert [d.page_content for d in documents] == [hit.chunk.text for hit in expected]
    assert [d.metadata["rank"] for d in documents] == [1, 2, 3]
    top = documents[0].metadata
    assert top["source"].endswith("ferries.jsonl") and top["location"] == "line 1"
    assert top["score"] == pytest.approx(expected[0].score)


def test_llamaindex_retriever_returns_scored_nodes_in_retrieval_order(retriever):
    pytest.importorskip("llama_index.core")
    from llama_index.core.retrievers import BaseRetriever

    li = llamaindex_retriever(retriever, k=3)
    assert isinstance(li, BaseRetriever)
    nodes = li.retrieve(QUESTION)
    expected = retriever.retrieve(QUESTION, 3)
    assert [n.node.get_content() for n in nodes] == [hit.chunk.text for hit in expected]
    assert [n.score for n in nodes] == pytest.approx([hit.score for hit in expected])
    assert nodes[0].node.metadata["source"].endswith("ferries.jsonl")
    # Offsets and scores are bookkeeping: kept in metadata, not shown to the LLM.
    llm_view = nodes[0].node.get_content(metadata_mode="llm")
    assert "Ferry Gannet" in llm_view and "chunk_id" not in llm_view


def test_retrievers_open_an_index_folder_and_check_its_model(tmp_path, retriever):
    from rag_mspoe.pipelines.index import IndexMismatchError

    with pytest.raises(IndexMismatchError):
        langchain_retriever(retriever, embedding_model="BAAI/bge-small-en-v1.5")
    with pytest.raises(FileNotFoundError, match="No index at"):
        llamaindex_retriever(tmp_path / "missing")
    opened = langchain_retriever(retriever.index.path, k=1)
    assert len(opened.invoke(QUESTION)) == 1
