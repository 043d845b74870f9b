"""The lost-in-the-middle QA prompt over documents, one a line: `Document [1](Title: ...) text`.

The packer of the RAG pipelines writes it, and so do the methods that measure or read a model
on such prompts (the reference layouts of attention calibration).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from rag_mspoe.prompts.document_prompts import lines_with_spans

QA_INSTRUCTION = (
    "Write a high-quality answer for the given question using only the provided search results "
    "(some of which might be irrelevant)."
)
# Added after the instruction when an answer should say which documents it used.
CITE_INSTRUCTION = "Cite the search results you use as [Document i]."


def format_document(number: int, title: str, text: str) -> str:
    # One document per line, as in the benchmark; line breaks inside a chunk become spaces.
    return f"Document [{number}](Title: {_one_line(title)}) {_one_line(text)}"


def render_qa_prompt(
    question: str, documents: Sequence[tuple[str, str]], *, cite: bool = False
) -> tuple[str, list[tuple[int, int]]]:
    """The QA prompt over (title, text) documents, and the character span of each document's line."""
    instruction = f"{QA_INSTRUCTION} {CITE_INSTRUCTION}" if cite else QA_INSTRUCTION
    lines = [format_document(number, title, body) for number, (title, body) in enumerate(documents, start=1)]
    text, spans = lines_with_spans(f"{instruction}\n\n", lines)
    return f"{text}\n\nQuestion: {question.strip()}\nAnswer:", spans


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()
