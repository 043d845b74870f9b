"""The lost-in-the-middle prompts, character for character.

Each prompt is sent as one user message through the model's chat template. Its last line is the
answer cue ("Answer:" or "Corresponding value:"), so the assistant's reply is the answer itself:
scoring an answer means scoring it as the start of that reply, with no further prefix.
"""

from __future__ import annotations

from rag_mspoe.eval.data.records import KVExample, QAExample

QA_INSTRUCTION = (
    "Write a high-quality answer for the given question using only the provided search results "
    "(some of which might be irrelevant)."
)
KV_INSTRUCTION = "Extract the value corresponding to the specified key in the JSON object below."
QA_ANSWER_CUE = "Answer:"
KV_ANSWER_CUE = "Corresponding value:"


def qa_prompt(example: QAExample) -> str:
    """The multi-document QA prompt: documents numbered from 1 in the example's order."""
    if not example.documents:
        raise ValueError(f"QA example {example.id!r} has no documents; a QA prompt needs at least one.")
    search_results = "\n".join(
        f"Document [{number}](Title: {document.title}) {document.text}"
        for number, document in enumerate(example.documents, start=1)
    )
    return f"{QA_INSTRUCTION}\n\n{search_results}\n\nQuestion: {example.question}\n{QA_ANSWER_CUE}"


def kv_json(example: KVExample) -> str:
    """The pairs as one JSON object, one pair per line."""
    return "{" + ",\n ".join(f'"{key}": "{value}"' for key, value in example.pairs) + "}"


def kv_prompt(example: KVExample) -> str:
    """The key-value retrieval prompt over `kv_json`."""
    return f'{KV_INSTRUCTION}\n\nJSON data:\n{kv_json(example)}\n\nKey: "{example.key}"\n{KV_ANSWER_CUE}'
