"""Answering: citations mapped back to source files, and one end-to-end answer with the embedded model."""

from __future__ import annotations

from pathlib import Path

import pytest
from pipelines_helpers import embedder, write_corpus

from rag_mspoe.pipelines.answer import answer_question, parse_citations
from rag_mspoe.pipelines.chunking import Chunk
from rag_mspoe.pipelines.index import ChunkIndex
from rag_mspoe.pipelines.indexing import index_documents
from rag_mspoe.pipelines.retrieval import RetrievedChunk, Retriever

PACKED = [
    RetrievedChunk(Chunk("/docs/harbour.md", "Harbour", "dredged in 1787", 10, 25), 0.8, 1, 7),
    RetrievedChunk(Chunk("/docs/ferries.jsonl", "Ferry", "38 minutes", 0, 10, "line 2"), 0.6, 2, 3),
    RetrievedChunk(Chunk("/docs/mill.pdf", "Mill", "eleven sails", 120, 132), 0.5, 3, 9),
]


def test_citations_map_document_numbers_to_sources():
    text = "It was dredged in 1787 [Document 1], and the ferry takes 38 minutes (Document [2]). See [3]."
    citations, unknown = parse_citations(text, PACKED)
    assert [(c.number, c.source, c.location, c.start, c.end, c.chunk_id) for c in citations] == [
        (1, "/docs/harbour.md", None, 10, 25, 7),
        (2, "/docs/ferries.jsonl", "line 2", 0, 10, 3),
        (3, "/docs/mill.pdf", None, 120, 132, 9),
    ]
    assert unknown == []


def test_citations_keep_first_mention_order_and_report_unknown_numbers():
    citations, unknown = parse_citations(
        "Per document 3 and [Document 1]; also [Document 3] and [Document 9].", PACKED
    )
    assert [c.number for c in citations] == [3, 1]
    assert unknown == [9]
    assert parse_citations("No sources here, 1787 and 38.", PACKED) == ([], [])


def test_citations_of_a_reordered_prompt_name_the_chunks_the_model_read():
    # The model read the third packed chunk as 'Document [1]' and the first as 'Document [2]'.
    citations, unknown = parse_citations("Sails [Document 1]; dredged [2]; ferry [3].", PACKED, read=(2, 0))
    assert [(c.number, c.source) for c in citations] == [(1, "/docs/mill.pdf"), (2, "/docs/harbour.md")]
    assert unknown == [3]  # the model read two documents


def test_citations_of_a_prompt_that_read_a_document_again_keep_its_number():
    # Every chunk in place and the second read again after the last, still numbered 2.
    citations, unknown = parse_citations("Ferry [Document 2]; mill [3]; [4].", PACKED, read=(0, 1, 2, 1))
    assert [(c.number, c.source) for c in citations] == [(2, "/docs/ferries.jsonl"), (3, "/docs/mill.pdf")]
    assert unknown == [4]


@pytest.mark.slow
def test_answer_end_to_end_with_the_embedded_model(tmp_path, embedded):
    from rag_mspoe.engine import Engine

    docs = write_corpus(tmp_path / "docs")
    index_documents(docs, tmp_path / "index", embedder=embedder(), progress=False)
    retriever = Retriever(ChunkIndex.load(tmp_path / "index"), embedder())
    engine = Engine(*embedded)
    question = "Who dredged the harbour of Vossel?"

    answer = answer_question(question, retriever, engine, k=3, max_new_tokens=24, method="mspoe")

    assert answer.text and answer.completion_tokens <= 24
    assert answer.method == "mspoe"
    assert set(answer.timings) == {"retrieve", "pack", "generate"}
    assert [item.rank for item in answer.packed.documents] == [1, 2, 3]  # retrieval order, nothing dropped
    assert Path(answer.packed.documents[0].chunk.source).name == "harbour.md"
    assert answer.packed.prompt.index("Tilda Marsk") < answer.packed.prompt.index("Question:")
    assert answer.prompt_tokens == engine.count_tokens(answer.packed.prompt)
    # Whatever the model cites, each citation names the packed chunk with that number.
    for citation in answer.citations:
        assert citation.source == answer.packed.documents[citation.number - 1].chunk.source
