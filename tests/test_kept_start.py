"""A calibrated reordering's answer starts from the rows its ranking pass read: when the order stays,
only the question is read again, and the answer is the one a full prefill gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from eval_run_helpers import tiny_chat_model
from forward_counts import counted_forwards

from rag_mspoe.attention.reorder import CalibratedReorder
from rag_mspoe.engine import Engine
from rag_mspoe.eval.data.loaders import load_qa
from rag_mspoe.eval.data.prompts import qa_prompt
from rag_mspoe.eval.data.records import with_gold_at
from rag_mspoe.eval.data.synthetic import generate_invented_qa
from rag_mspoe.eval.sweep.batch_scorer import prompt_of

SEARCH_QUESTIONS = Path(__file__).parents[1] / "docs" / "results" / "nq10-split" / "search-10.jsonl.gz"
# A margin no ranking reaches: the order always stays. Strength 0 needs no bias estimate.
KEEPS_ORDER = CalibratedReorder(strength=0.0, min_margin=2.0)


@pytest.fixture
def engine(tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_MSPOE_CACHE", str(tmp_path / "cache"))
    return Engine(*tiny_chat_model(), method="none")


@pytest.fixture
def prompt():
    return prompt_of(with_gold_at(generate_invented_qa(6, 1, seed=3)[0], 2))


def answer(engine: Engine, prompt: Any, shared: bool, **settings: Any) -> tuple[Any, int]:
    engine.document_prefixes.clear()
    engine.shared_prompt_starts = shared
    result, counts = counted_forwards(engine, lambda: engine.generate(prompt, max_new_tokens=8, **settings))
    return result, counts.tokens


def test_a_kept_order_reads_the_documents_once(engine, prompt):
    full, full_tokens = answer(engine, prompt, shared=False, method=KEEPS_ORDER)
    kept, kept_tokens = answer(engine, prompt, shared=True, method=KEEPS_ORDER)
    assert kept == full
    assert kept.documents_read == tuple(range(6))
    ids, spans = engine.document_spans_of(KEEPS_ORDER, prompt)
    # The ranking pass read the prompt through its documents once; the answer, only what follows.
    assert full_tokens - kept_tokens >= spans[-1][1] - 1


def test_a_kept_start_is_drafted_from_and_answers_as_a_full_prefill(engine, prompt):
    engine.prompt_lookup_tokens = 10
    try:
        kept, kept_tokens = answer(engine, prompt, shared=True, method=KEEPS_ORDER)
        full, full_tokens = answer(engine, prompt, shared=False, method=KEEPS_ORDER)
    finally:
        engine.prompt_lookup_tokens = 0
    plain, _ = answer(engine, prompt, shared=False, method=KEEPS_ORDER)
    assert kept == full == plain
    # The same drafts either way; the kept start spared reading the documents again.
    ids, spans = engine.document_spans_of(KEEPS_ORDER, prompt)
    assert full_tokens - kept_tokens >= spans[-1][1] - 1


def test_a_document_read_again_after_the_last_reads_the_others_once(engine, prompt):
    repeat = CalibratedReorder(strength=0.0, place="repeat")
    full, full_tokens = answer(engine, prompt, shared=False, method=repeat)
    kept, kept_tokens = answer(engine, prompt, shared=True, method=repeat)
    assert kept == full
    assert len(kept.documents_read) == 7 and kept.documents_read[:6] == tuple(range(6))
    ids, spans = engine.document_spans_of(repeat, prompt)
    assert full_tokens - kept_tokens >= spans[-1][1] - 1


def test_a_raw_prompt_reads_a_document_again_and_says_so(engine):
    from rag_mspoe.prompts.qa_prompt import render_qa_prompt

    text, _ = render_qa_prompt("Who?", [("A", "alpha one"), ("B", "beta two"), ("C", "gamma three")])
    repeat = CalibratedReorder(strength=0.0, place="repeat")
    result = engine.generate(text, method=repeat, max_new_tokens=2, raw=True)
    assert len(result.documents_read) == 4 and result.documents_read[:3] == (0, 1, 2)


def test_a_short_shared_start_is_read_again(engine, prompt):
    engine.shared_prompt_starts = True
    ids, spans = engine.document_spans_of(KEEPS_ORDER, prompt)
    engine.document_prefixes.copy_of(ids[: spans[0][0]])  # only the template before the documents
    _, counts = counted_forwards(engine, lambda: engine.generate(prompt, method="none", max_new_tokens=1))
    assert counts.tokens == engine.count_tokens(prompt)


def rows_through_last_layer(engine: Engine) -> list[int]:
    """The rows each forward runs through the model's last layer."""
    rows: list[int] = []
    engine.model.model.layers[-1].register_forward_hook(lambda _m, args, _o: rows.append(args[0].shape[1]))
    return rows


@pytest.mark.parametrize("min_margin", [0.0, 2.0])
def test_a_ranking_by_lower_layers_stops_there_and_answers_as_one_full_pass(engine, prompt, min_margin):
    lower = CalibratedReorder(strength=0.0, layers=[1], min_margin=min_margin)
    rows = rows_through_last_layer(engine)
    rewritten = lower.rewrite(engine, prompt)
    assert rows == []  # layers 2 and 3 did not run
    # The same order as the ranking pass that reads every layer (what sweeps record).
    engine.document_prefixes.clear()
    assert rewritten == lower.reordered(engine, prompt, lower.ranking_attention(engine, prompt))
    full, _ = answer(engine, prompt, shared=False, method=lower)
    rows.clear()
    cut, _ = answer(engine, prompt, shared=True, method=lower)
    assert cut == full
    if min_margin:  # the order stays: the upper layers read the prompt once, then the answer's tokens
        assert sum(rows) == len(engine.document_spans_of(lower, prompt)[0]) + 7


@pytest.fixture(scope="module")
def qwen_default_engine():
    try:
        return Engine.load("qwen2.5-coder-0.5b-instruct", threads=1)  # its answering default
    except (RuntimeError, ValueError, OSError) as exc:
        pytest.skip(f"the embedded Qwen2.5-Coder-0.5B is not installed: {exc}")


@pytest.mark.slow
@pytest.mark.parametrize("question", [0, 3])  # the 4th one's answer moved when the rest took SDPA
def test_on_the_quantised_default_path_a_kept_start_answers_as_the_whole_read(qwen_default_engine, question):
    prompt = qa_prompt(with_gold_at(load_qa(SEARCH_QUESTIONS)[question], 0))
    engine = qwen_default_engine
    whole, _ = answer(engine, prompt, shared=False, method="none")
    read_again, full_tokens = answer(engine, prompt, shared=False, method=KEEPS_ORDER)
    kept, kept_tokens = answer(engine, prompt, shared=True, method=KEEPS_ORDER)
    assert kept.text == read_again.text == whole.text
    _, spans = engine.document_spans_of(KEEPS_ORDER, prompt)
    assert full_tokens - kept_tokens >= spans[-1][1] - 1  # the kept start's documents were not read again
