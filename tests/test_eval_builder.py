"""Building QA examples from oracle records with the FAISS + MiniLM retriever: distractors are the
top retrieved passages without the answer, in retrieval order, and the gold goes where asked."""

from __future__ import annotations

import pytest

from rag_mspoe.eval.data.build_qa import build_from_oracle, pool_from_examples
from rag_mspoe.eval.data.records import Document, QAExample, gold_index, with_gold_at
from rag_mspoe.eval.data.synthetic import generate_invented_qa
from rag_mspoe.eval.scoring.metrics import normalize_answer
from rag_mspoe.pipelines.embedding import Embedder

QUESTION = "In what year was the town of Velmora founded?"
GOLD = {"title": "Velmora", "text": "Velmora was founded in 1743 by settlers from the coast."}
RECORD = {"question": QUESTION, "answers": ["1743", "the year 1743"], "ctxs": [{**GOLD, "isgold": True}]}
# Passages that would rank near the top but give the answer away, in the text or only in the title.
LEAKS = [
    Document("Velmora history", "The town of Velmora was founded in the year 1743."),
    Document(
        "Velmora", "Velmora, founded 1,743 days after the flood, is a town."
    ),  # "1,743" normalises to 1743
    Document("1743", "The year in which the town of Velmora was founded."),
]
NEAR_MISS = Document("Velmora river", "The town of Velmora was founded beside a river, long ago.")


@pytest.fixture(scope="module")
def embedder():
    return Embedder.load()


@pytest.fixture(scope="module")
def pool():
    background = pool_from_examples(generate_invented_qa(4, 10, seed=1))
    return [*background[:12], *LEAKS, *background[12:], NEAR_MISS]


def similarities(embedder, documents):
    query = embedder.embed_queries([QUESTION])[0]
    return embedder.embed([f"{d.title}\n{d.text}" for d in documents]) @ query


def test_distractors_are_the_top_answer_free_passages_in_retrieval_order(embedder, pool):
    (example,) = build_from_oracle([RECORD], pool, 6, gold_index=2, embedding_model=embedder)
    assert example.question == QUESTION and example.answers == ("1743", "the year 1743")
    assert len(example.documents) == 6 and gold_index(example) == 2
    assert example.documents[2] == Document(GOLD["title"], GOLD["text"], is_gold=True, has_answer=True)
    distractors = [d for d in example.documents if not d.is_gold]
    for document in distractors:
        assert "1743" not in normalize_answer(f"{document.title} {document.text}")
        assert not document.is_gold and not document.has_answer
    assert distractors[0] == Document(NEAR_MISS.title, NEAR_MISS.text)  # the closest passage without it
    # The leaks rank above the chosen distractors: excluded for their answer, not their rank.
    leak_scores = similarities(embedder, LEAKS)
    chosen_scores = similarities(embedder, distractors)
    assert leak_scores.min() > chosen_scores[-1]
    assert list(chosen_scores) == sorted(chosen_scores, reverse=True)
    # Nothing answer-free that was left out beats the last one chosen.
    free = [d for d in pool if d not in LEAKS and Document(d.title, d.text) not in distractors]
    assert similarities(embedder, free).max() <= chosen_scores[-1] + 1e-6


def test_other_gold_positions_equal_moving_the_gold(embedder, pool):
    at_zero = build_from_oracle([RECORD], pool, 5, gold_index=0, embedding_model=embedder)[0]
    at_four = build_from_oracle([RECORD], pool, 5, gold_index=4, embedding_model=embedder)[0]
    assert with_gold_at(at_zero, 4) == at_four
    assert gold_index(at_four) == 4


def test_oracle_record_shapes(embedder, pool):
    annotated = {"question": QUESTION, "answers": ["1743"], "nq_annotated_gold": {
        "title": GOLD["title"], "chunked_long_answer": GOLD["text"], "long_answer": "..."}}  # fmt: skip
    plain = {"id": "v-1", "question": QUESTION, "answers": ["1743"], "gold": GOLD}
    marked = {"question": QUESTION, "answers": ["1743"], "ctxs": [
        {"title": "other", "text": "not gold", "isgold": False}, {**GOLD, "isgold": True}]}  # fmt: skip
    examples = build_from_oracle([annotated, plain, marked], pool, 3, gold_index=1, embedding_model=embedder)
    assert [e.id for e in examples] == ["0", "v-1", "2"]
    assert {e.documents[1] for e in examples} == {Document(GOLD["title"], GOLD["text"], True, True)}
    assert len({e.documents for e in examples}) == 1


def test_builder_errors(embedder, pool):
    with pytest.raises(ValueError, match="Oracle record 1 has no gold passage"):
        build_from_oracle([RECORD, {"question": "q", "answers": ["a"]}], pool, 3, embedding_model=embedder)
    with pytest.raises(ValueError, match="Oracle record 0 needs 'answers'"):
        build_from_oracle([{"question": "q", "answers": [], "gold": GOLD}], pool, 3, embedding_model=embedder)
    with pytest.raises(ValueError, match=r"gold_index must be in \[0, 2\]"):
        build_from_oracle([RECORD], pool, 3, gold_index=3, embedding_model=embedder)
    free = len(pool) - len(LEAKS)
    with pytest.raises(ValueError, match=f"only {free} passages of the pool are free of its answers"):
        build_from_oracle([RECORD], pool, free + 2, embedding_model=embedder)


def test_the_pool_index_is_saved_and_reused(embedder, pool, tmp_path, monkeypatch):
    folder = tmp_path / "pool-index"
    first = build_from_oracle([RECORD], pool, 4, embedding_model=embedder, index_path=folder)
    assert (folder / "meta.json").is_file()

    def no_embedding(*args, **kwargs):
        raise AssertionError("the pool was embedded again")

    with monkeypatch.context() as patch:
        patch.setattr(Embedder, "embed", no_embedding)
        assert build_from_oracle([RECORD], pool, 4, embedding_model=embedder, index_path=folder) == first
    with pytest.raises(ValueError, match="another passage pool"):
        build_from_oracle([RECORD], pool[:-1], 4, embedding_model=embedder, index_path=folder)


def test_pool_from_examples_keeps_distinct_non_gold_documents():
    shared = Document("shared", "the same passage")
    examples = [
        QAExample("a", "q", ("x",), (Document("g", "x", is_gold=True, has_answer=True), shared)),
        QAExample("b", "q", ("y",), (shared, Document("d", "other"), Document("h", "y", has_answer=True))),
    ]
    assert pool_from_examples(examples) == [shared, Document("d", "other")]
    assert len(pool_from_examples(generate_invented_qa(3, 4, seed=0))) == 4 * 2  # two distractors each
