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


def qa_prompt_with_spans(example: QAExample) -> tuple[str, list[tuple[int, int]]]:
    """`qa_prompt` and the character span [start, end) of each document's line in it, in order."""
    if not example.documents:
        raise ValueError(f"QA example {example.id!r} has no documents; a QA prompt needs at least one.")
    lines = [
        f"Document [{number}](Title: {document.title}) {document.text}"
        for number, document in enumerate(example.documents, start=1)
    ]
    text, spans = lines_with_spans(f"{QA_INSTRUCTION}\n\n", lines)
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


def prompt_message(example: QAExample | KVExample) -> list[dict[str, Any]]:
    """The example's prompt as the one user message the model gets, with where its documents (or
    pairs) are, for methods that read them (`rag_mspoe.prompts.document_prompts`)."""
    if isinstance(example, KVExample):
        text, spans = kv_prompt_with_spans(example)
    else:
        text, spans = qa_prompt_with_spans(example)
    return [document_message(text, spans)]
