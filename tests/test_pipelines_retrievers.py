"""The index as a LangChain and a LlamaIndex retriever: same chunks, same order, sources in metadata."""

from __future__ import annotations

import inspect

import pytest
from pipelines_helpers import embedder, write_corpus

from rag_mspoe.connectors.retrievers import langchain_retriever, llamaindex_retriever
from rag_mspoe.pipelines.index import ChunkIndex
from rag_mspoe.pipelines.indexing import index_documents
from rag_mspoe.pipelines.retrieval import Retriever

QUESTION = "How long does the Gannet take to cross the Pell Sound?"


@pytest.fixture(scope="module")
def chunk_retriever(tmp_path_factory):
    folder = tmp_path_factory.mktemp("retrievers")
    index_documents(write_corpus(folder / "docs"), folder / "index", embedder=embedder(), progress=False)
    return Retriever(ChunkIndex.load(folder / "index"), embedder())


def test_langchain_retriever_returns_the_chunks_in_retrieval_order(chunk_retriever):
    pytest.importorskip("langchain_core")
    from langchain_core.retrievers import BaseRetriever

    lc = langchain_retriever(chunk_retriever, k=3)
    assert isinstance(lc, BaseRetriever)
    documents = lc.invoke(QUESTION)
    expected = chunk_retriever.retrieve(QUESTION, 3)
    assert [d.page_content for d in documents] == [hit.chunk.text for hit in expected]
    assert [d.metadata["rank"] for d in documents] == [1, 2, 3]
    top = documents[0].metadata
    assert top["source"].endswith("ferries.jsonl") and top["location"] == "line 1"
    assert top["score"] == pytest.approx(expected[0].score)


def test_llamaindex_retriever_returns_scored_nodes_in_retrieval_order(chunk_retriever):
    pytest.importorskip("llama_index.core")
    from llama_index.core.retrievers import BaseRetriever

    li = llamaindex_retriever(chunk_retriever, k=3)
    assert isinstance(li, BaseRetriever)
    nodes = li.retrieve(QUESTION)
    expected = chunk_retriever.retrieve(QUESTION, 3)
    assert [n.node.get_content() for n in nodes] == [hit.chunk.text for hit in expected]
    assert [n.score for n in nodes] == pytest.approx([hit.score for hit in expected])
    assert nodes[0].node.metadata["source"].endswith("ferries.jsonl")
    # Offsets and scores are bookkeeping: kept in metadata, not shown to the LLM.
    llm_view = nodes[0].node.get_content(metadata_mode="llm")
    assert "Ferry Gannet" in llm_view and "chunk_id" not in llm_view


def test_retrievers_open_an_index_folder_and_check_its_model(tmp_path, chunk_retriever):
    from rag_mspoe.pipelines.index import IndexMismatchError

    with pytest.raises(IndexMismatchError):
        langchain_retriever(chunk_retriever, embedding_model="BAAI/bge-small-en-v1.5")
    with pytest.raises(FileNotFoundError, match="No index at"):
        llamaindex_retriever(tmp_path / "missing")
    opened = langchain_retriever(chunk_retriever.index.path, k=1)
    assert len(opened.invoke(QUESTION)) == 1


def test_langchain_retriever_takes_k_per_call(chunk_retriever):
    pytest.importorskip("langchain_core")
    lc = langchain_retriever(chunk_retriever, k=3)
    assert len(lc.invoke(QUESTION, k=1)) == 1 and len(lc.invoke(QUESTION)) == 3
    with pytest.raises(ValueError, match="k must be a positive"):
        lc.invoke(QUESTION, k=0)


langchain_tests = pytest.importorskip("langchain_tests.integration_tests")

# The suite's async tests carry no pytest-asyncio mark: mark them where they are defined, as
# test_langchain_standard.py does for the chat model suite.
for _name, _test in inspect.getmembers(
    langchain_tests.RetrieversIntegrationTests, inspect.iscoroutinefunction
):
    if _name.startswith("test_"):
        pytest.mark.asyncio(_test)


class TestLangChainRetrieverStandard(langchain_tests.RetrieversIntegrationTests):
    """langchain-tests' retriever suite over a real index of the test corpus."""

    @pytest.fixture(autouse=True)
    def _index(self, chunk_retriever):
        type(self).index = chunk_retriever

    @property
    def retriever_constructor(self):
        return langchain_retriever_class()

    @property
    def retriever_constructor_params(self):
        return {"retriever": type(self).index, "k": 2}

    @property
    def retriever_query_example(self):
        return QUESTION


def langchain_retriever_class():
    from rag_mspoe.connectors.langchain_retriever import LangChainRetriever

    return LangChainRetriever
