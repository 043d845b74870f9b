"""The lost-in-the-middle prompts, character for character.

Each prompt is sent as one user message through the model's chat template. Its last line is the
answer cue ("Answer:" or "Corresponding value:"), so the assistant's reply is the answer itself:
scoring an answer means scoring it as the start of that reply, with no further prefix.
"""

from __future__ import annotations

from typing import Any

from rag_mspoe.eval.data.records import KVExample, QAExample
from rag_mspoe.prompts.document_prompts import document_message, lines_with_spans

QA_INSTRUCTION = (
    "Write a high-quality answer for the given question using only the provided search results "
    "(some of which might be irrelevant)."
)
KV_INSTRUCTION = "Extract the value corresponding to the specified key in the JSON object below."
QA_ANSWER_CUE = "Answer:"
KV_ANSWER_CUE = "Corresponding value:"


def qa_prompt(example: QAExample) -> str:
    """The multi-document QA prompt: documents numbered from 1 in the example's order."""
    return qa_prompt_with_spans(example)[0]


def qa_prompt_with_spans(example: QAExample, order_free: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """`qa_prompt` and the character span [start, end) of each document's line in it, in order.

    order_free: the same text, told as a method that reads the documents as a set (PINE) needs it,
    so each document reads the same wherever it stands: the documents are numbered in the order
    of their content (title, then text), not of the prompt (numbered by place, moving the gold
    changed its text, 'Document [1]' to 'Document [3]'), and each span holds its line's break (the
    last line's too, the first of the blank line before the question, which the tokenizers of the
    embedded models read as a token of its own)."""
    if not example.documents:
        raise ValueError(f"QA example {example.id!r} has no documents; a QA prompt needs at least one.")
    order = list(range(len(example.documents)))
    if order_free:
        order.sort(key=lambda i: (example.documents[i].title, example.documents[i].text))
    number = {index: place for place, index in enumerate(order, start=1)}
    lines = [
        f"Document [{number[index]}](Title: {document.title}) {document.text}"
        for index, document in enumerate(example.documents)
    ]
    text, spans = lines_with_spans(f"{QA_INSTRUCTION}\n\n", lines)
    if order_free:
        spans = [(start, end + 1) for start, end in spans]
    return f"{text}\n\nQuestion: {example.question}\n{QA_ANSWER_CUE}", spans


def kv_json(example: KVExample) -> str:
    """The pairs as one JSON object, one pair per line."""
    return kv_json_with_spans(example)[0]


def kv_json_with_spans(example: KVExample) -> tuple[str, list[tuple[int, int]]]:
    """`kv_json` and the character span of each pair in it: the pairs are its documents."""
    text, spans = "{", []
    for number, (key, value) in enumerate(example.pairs):
        if number:
            text += ",\n "
        pair = f'"{key}": "{value}"'
        spans.append((len(text), len(text) + len(pair)))
        text += pair
    return text + "}", spans


def kv_prompt(example: KVExample) -> str:
    """The key-value retrieval prompt over `kv_json`."""
    return kv_prompt_with_spans(example)[0]


def kv_prompt_with_spans(example: KVExample) -> tuple[str, list[tuple[int, int]]]:
    """`kv_prompt` and the character span of each pair in it."""
    head = f"{KV_INSTRUCTION}\n\nJSON data:\n"
    data, spans = kv_json_with_spans(example)
    prompt = f'{head}{data}\n\nKey: "{example.key}"\n{KV_ANSWER_CUE}'
    return prompt, [(start + len(head), end + len(head)) for start, end in spans]


def prompt_message(example: QAExample | KVExample, order_free: bool = False) -> list[dict[str, Any]]:
    """The example's prompt as the one user message the model gets, with where its documents (or
    pairs) are, for methods that read them (`rag_mspoe.prompts.document_prompts`).
    order_free: as `qa_prompt_with_spans` takes it (key-value pairs read alike anywhere already)."""
    if isinstance(example, KVExample):
        text, spans = kv_prompt_with_spans(example)
    else:
        text, spans = qa_prompt_with_spans(example, order_free)
    return [document_message(text, spans)]
