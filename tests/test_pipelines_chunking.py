"""Chunking by embedding-model tokens, with offsets back into the document."""

from __future__ import annotations

import pytest
from pipelines_helpers import embedder

from rag_mspoe.pipelines.chunking import check_chunking, chunk_documents
from rag_mspoe.pipelines.ingest import Document

TEXT = " ".join(f"Sentence {i} tells of harbour {i * 7} and its keeper." for i in range(60))


def _tokens(text: str) -> list[int]:
    return embedder().tokenizer(text, add_special_tokens=False)["input_ids"]


def test_chunks_are_spans_of_at_most_chunk_size_tokens_with_overlap():
    doc = Document(source="/docs/long.txt", title="Long", text=TEXT)
    chunks = chunk_documents([doc], embedder().tokenizer, chunk_size=50, overlap=10, progress=False)

    total = len(_tokens(TEXT))
    assert len(chunks) == -(-(total - 10) // 40)  # windows of 50 advancing by 40 cover every token
    for chunk in chunks:
        assert chunk.text == TEXT[chunk.start : chunk.end]
        assert len(_tokens(chunk.text)) <= 50
        assert (chunk.source, chunk.title) == ("/docs/long.txt", "Long")
    assert chunks[0].start == 0 and chunks[-1].end == len(TEXT)
    for before, after in zip(chunks, chunks[1:], strict=False):
        assert after.start < before.end  # neighbours overlap...
        assert len(_tokens(TEXT[after.start : before.end])) == 10  # ...by exactly the overlap


def test_short_document_is_one_chunk_and_keeps_its_location():
    doc = Document(source="/docs/f.jsonl", title="F", text="A short record.", location="line 4")
    (chunk,) = chunk_documents([doc], embedder().tokenizer, chunk_size=50, overlap=10, progress=False)
    assert (chunk.text, chunk.start, chunk.end, chunk.location) == ("A short record.", 0, 15, "line 4")
    assert chunk.document_key == "/docs/f.jsonl#line 4"


@pytest.mark.parametrize(
    ("size", "overlap", "limit", "message"),
    [
        (0, 0, None, "at least 1"),
        (10, 10, None, "between 0 and"),
        (10, -1, None, "between 0 and"),
        (300, 0, 254, "254"),
    ],
)
def test_bad_chunk_settings_are_refused(size, overlap, limit, message):
    with pytest.raises(ValueError, match=message):
        check_chunking(size, overlap, limit)
