"""Packing retrieved chunks: benchmark format, retrieval order kept, token budget, explicit reordering."""

from __future__ import annotations

import pytest

from rag_mspoe.pipelines.chunking import Chunk
from rag_mspoe.pipelines.packing import pack, prompt_budget, render_prompt
from rag_mspoe.pipelines.retrieval import RetrievedChunk
from rag_mspoe.prompts.document_order import long_context_reorder
from rag_mspoe.prompts.qa_prompt import QA_INSTRUCTION, format_document


@pytest.fixture(scope="module")
def engine(embedded):
    from rag_mspoe.engine import Engine

    model, tokenizer = embedded
    return Engine(model, tokenizer)


def _retrieved(n: int) -> list[RetrievedChunk]:
    """n chunks as retrieval returns them: rank 1 first, scores falling."""
    return [
        RetrievedChunk(
            chunk=Chunk(
                source=f"/docs/file{i}.md",
                title=f"Title {i}",
                text=f"Chunk {i} says that lantern {i} burns\nfor {10 + i} hours.",
                start=0,
                end=40,
            ),
            score=1.0 - i / 100,
            rank=i,
            chunk_id=100 + i,
        )
        for i in range(1, n + 1)
    ]


def test_prompt_has_the_lost_in_the_middle_format():
    prompt = render_prompt("How long does lantern 2 burn?", _retrieved(2))
    assert prompt == (
        "Write a high-quality answer for the given question using only the provided search results "
        "(some of which might be irrelevant).\n\n"
        "Document [1](Title: Title 1) Chunk 1 says that lantern 1 burns for 11 hours.\n"
        "Document [2](Title: Title 2) Chunk 2 says that lantern 2 burns for 12 hours.\n\n"
        "Question: How long does lantern 2 burn?\nAnswer:"
    )
    assert render_prompt("q", _retrieved(1), cite=True).startswith(
        QA_INSTRUCTION + " Cite the search results"
    )


def test_everything_fits_in_a_large_window_in_retrieval_order(engine):
    retrieved = _retrieved(7)
    packed = pack("How long?", retrieved, count_tokens=engine.count_tokens, budget=prompt_budget(8192, 64))
    assert packed.documents == retrieved and packed.dropped == []
    positions = [packed.prompt.index(f"Chunk {i} says") for i in range(1, 8)]
    assert positions == sorted(positions)
    assert packed.prompt_tokens == engine.count_tokens(packed.prompt)


def test_a_tiny_window_drops_chunks_from_the_bottom(engine):
    retrieved = _retrieved(10)
    question = "How long does lantern 3 burn?"
    # A context window that holds the question and about four chunks.
    four = engine.count_tokens(render_prompt(question, retrieved[:4]))
    window = four + 32 + 5
    packed = pack(question, retrieved, count_tokens=engine.count_tokens, budget=prompt_budget(window, 32))

    assert packed.documents == retrieved[:4]
    assert packed.dropped == retrieved[4:]
    assert packed.prompt_tokens == engine.count_tokens(packed.prompt) <= packed.budget == window - 32
    # One more chunk would not have fitted.
    assert engine.count_tokens(render_prompt(question, retrieved[:5])) > packed.budget


def test_a_question_longer_than_the_budget_is_an_error(engine):
    with pytest.raises(ValueError, match="question alone takes"):
        pack("why " * 200, _retrieved(3), count_tokens=engine.count_tokens, budget=100)
    with pytest.raises(ValueError, match="leaves no room"):
        prompt_budget(256, 256)


def test_long_context_reorder_only_when_asked(engine):
    retrieved = _retrieved(6)
    default = pack("q", retrieved, count_tokens=engine.count_tokens, budget=4000)
    reordered = pack("q", retrieved, count_tokens=engine.count_tokens, budget=4000, reorder=True)
    assert [d.rank for d in default.documents] == [1, 2, 3, 4, 5, 6] and not default.reordered
    assert [d.rank for d in reordered.documents] == [2, 4, 6, 5, 3, 1] and reordered.reordered
    assert reordered.prompt.index("Chunk 2 says") < reordered.prompt.index("Chunk 4 says")


@pytest.mark.parametrize("n", range(8))
def test_long_context_reorder_arranges_like_llamaindex(n):
    pytest.importorskip("llama_index.core")
    from llama_index.core.postprocessor import LongContextReorder
    from llama_index.core.schema import NodeWithScore, TextNode

    retrieved = _retrieved(n)
    nodes = [NodeWithScore(node=TextNode(text=str(r.rank)), score=r.score) for r in retrieved]
    theirs = [int(node.node.get_content()) for node in LongContextReorder().postprocess_nodes(nodes)]
    assert [item.rank for item in long_context_reorder(retrieved)] == theirs


def test_format_document_keeps_one_document_per_line():
    assert (
        format_document(3, "A\nTitle", "line one\n\n  line two ")
        == "Document [3](Title: A Title) line one line two"
    )
