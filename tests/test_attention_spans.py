"""Document spans: character spans from the packer and the QA prompt; token spans via real templates."""

from __future__ import annotations

import pytest
from attention_helpers import unnumbered_documents_prompt

from rag_mspoe.attention import DocumentSpans, char_to_token_spans, prompt_with_spans
from rag_mspoe.eval.data.prompts import qa_prompt, qa_prompt_with_spans
from rag_mspoe.eval.data.records import Document, QAExample
from rag_mspoe.prompts.chat_template import render
from rag_mspoe.prompts.qa_prompt import format_document, render_qa_prompt

TOKENIZERS = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]
DOCUMENTS = [
    ("Lanterns", "The harbour lantern burns for nine hours on one filling."),
    ("Bridges", "The old bridge was rebuilt in 1841, after the flood."),
    ("Bakeries", "Rye bread sells first; the bakery opens at six."),
]


def _tokenizer(name):
    from transformers import AutoTokenizer

    from rag_mspoe.models import embedded_models

    try:
        folder = embedded_models.prepare(name)
    except Exception as exc:  # the part packages of this model are not installed
        pytest.skip(f"{name}: {exc}")
    return AutoTokenizer.from_pretrained(folder)


def test_the_packer_and_the_qa_prompt_know_each_documents_characters():
    prompt, spans = render_qa_prompt("Who rebuilt the bridge?", DOCUMENTS)
    assert [prompt[s:e] for s, e in spans] == [
        format_document(i, t, x) for i, (t, x) in enumerate(DOCUMENTS, 1)
    ]
    example = QAExample(
        id="q1",
        question="Who rebuilt the bridge?",
        answers=("the town",),
        documents=tuple(Document(title=t, text=x) for t, x in DOCUMENTS),
    )
    text, char_spans = qa_prompt_with_spans(example)
    assert text == qa_prompt(example)
    assert [text[s:e] for s, e in char_spans] == [
        f"Document [{i}](Title: {t}) {x}" for i, (t, x) in enumerate(DOCUMENTS, 1)
    ]


@pytest.mark.parametrize("name", TOKENIZERS)
def test_token_spans_cover_exactly_each_document_in_the_chat_template(name):
    tokenizer = _tokenizer(name)
    prompt, char_spans = render_qa_prompt("Who rebuilt the bridge?", DOCUMENTS)
    ids, spans = prompt_with_spans(tokenizer, prompt, char_spans)
    assert ids == render(tokenizer, prompt)  # the very tokens the engine sends
    for (start, end), (s, e) in zip(spans, char_spans, strict=True):
        assert tokenizer.decode(ids[start:end]).strip() == prompt[s:e]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    raw_ids, raw_spans = prompt_with_spans(tokenizer, prompt, char_spans, raw=True)
    (start, end), (s, e) = raw_spans[1], char_spans[1]
    assert tokenizer.decode(raw_ids[start:end]).strip() == prompt[s:e]


def test_char_to_token_spans_gives_a_shared_token_to_the_first_document():
    offsets = [(0, 0), (0, 3), (3, 6), (6, 9), (9, 12)]  # a special token first
    assert char_to_token_spans(offsets, [(0, 4), (4, 12)]) == [(1, 3), (3, 5)]
    with pytest.raises(ValueError, match="No token covers"):
        char_to_token_spans(offsets, [(20, 30)])


def test_bad_spans_are_refused_with_the_rule():
    with pytest.raises(ValueError, match="0 <= start < end"):
        DocumentSpans.of([[(5, 5)]])
    with pytest.raises(ValueError, match="overlap or are out of order"):
        DocumentSpans.of([[(0, 5), (4, 8)]])
    with pytest.raises(TypeError, match="one list of"):
        DocumentSpans.of([[1, 2, 3]])
    assert DocumentSpans.of([[(0, 5)], []]).rows == (((0, 5),), ())


@pytest.mark.parametrize("name", TOKENIZERS)
def test_reordering_the_documents_before_the_last_reorders_whole_token_blocks(name):
    # What PINE's order-invariance needs from the tokenizer: each document with the separator
    # after it (Qwen merges a closing period with the line break) is the same tokens in any
    # place. The last document meets the question's blank line instead, so it stays last.
    tokenizer = _tokenizer(name)
    documents = [*DOCUMENTS, ("Ferries", "The ferry leaves at noon")]

    def blocks(order):
        ordered = [documents[i] for i in (*order, 3)]
        ids, spans = unnumbered_documents_prompt(tokenizer, ordered, "When does the ferry leave?")
        starts = [start for start, _ in spans]
        ends = [*starts[1:], spans[-1][1]]
        return ids[: starts[0]], [ids[s:e] for s, e in zip(starts, ends, strict=True)], ids[ends[-1] :]

    before, in_order, after = blocks((0, 1, 2))
    for order in [(2, 0, 1), (1, 2, 0)]:
        other_before, reordered, other_after = blocks(order)
        assert (other_before, other_after) == (before, after)
        assert reordered == [in_order[i] for i in order] + [in_order[3]]
