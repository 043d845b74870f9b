"""Pack retrieved chunks into a prompt in the lost-in-the-middle QA format, under a token budget.

Chunks go into the prompt in the order given (retrieval order, best first), numbered
`Document [1]`, `Document [2]`, ... When they do not all fit, chunks are dropped from the
bottom of that order and returned in `PackedPrompt.dropped`. `LongContextReorder` (best
chunks at both ends, weakest in the middle) is applied only when asked for.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from rag_mspoe.pipelines.retrieval import RetrievedChunk
from rag_mspoe.prompts.document_prompts import document_message, lines_with_spans

QA_INSTRUCTION = (
    "Write a high-quality answer for the given question using only the provided search results "
    "(some of which might be irrelevant)."
)
# Added after the instruction when an answer should say which documents it used.
CITE_INSTRUCTION = "Cite the search results you use as [Document i]."

T = TypeVar("T")


@dataclass(frozen=True)
class PackedPrompt:
    prompt: str
    documents: list[RetrievedChunk]  # in prompt order: `Document [i]` is documents[i - 1]
    dropped: list[RetrievedChunk]  # did not fit, in retrieval order
    prompt_tokens: int
    budget: int
    reordered: bool
    # Character range [start, end) of each document's line in `prompt`, in prompt order.
    document_spans: list[tuple[int, int]]

    @property
    def message(self) -> dict[str, Any]:
        """The prompt as a user message that says where its documents are (for the engine)."""
        return document_message(self.prompt, self.document_spans)


def format_document(number: int, title: str, text: str) -> str:
    # One document per line, as in the benchmark; line breaks inside a chunk become spaces.
    return f"Document [{number}](Title: {_one_line(title)}) {_one_line(text)}"


def render_prompt(question: str, documents: Sequence[RetrievedChunk], *, cite: bool = False) -> str:
    return render_prompt_with_spans(question, documents, cite=cite)[0]


def render_prompt_with_spans(
    question: str, documents: Sequence[RetrievedChunk], *, cite: bool = False
) -> tuple[str, list[tuple[int, int]]]:
    """The prompt and the character span of each document's line in it."""
    return render_qa_prompt(question, [(item.chunk.title, item.chunk.text) for item in documents], cite=cite)


def render_qa_prompt(
    question: str, documents: Sequence[tuple[str, str]], *, cite: bool = False
) -> tuple[str, list[tuple[int, int]]]:
    """The QA prompt over (title, text) documents, and the character span of each document's line."""
    instruction = f"{QA_INSTRUCTION} {CITE_INSTRUCTION}" if cite else QA_INSTRUCTION
    lines = [format_document(number, title, body) for number, (title, body) in enumerate(documents, start=1)]
    text, spans = lines_with_spans(f"{instruction}\n\n", lines)
    return f"{text}\n\nQuestion: {question.strip()}\nAnswer:", spans


def long_context_reorder(items: Sequence[T]) -> list[T]:
    """Given items best first, put the best ones at both ends and the weakest in the middle.

    The same arrangement as LangChain's and LlamaIndex's LongContextReorder: walking from the
    weakest item, items go alternately to the front and to the back (5 items: 1 3 5 4 2).
    """
    weakest_first = list(items)[::-1]
    return weakest_first[0::2][::-1] + weakest_first[1::2]


def prompt_budget(context_window: int, max_new_tokens: int) -> int:
    """Prompt tokens that leave room for the answer in the model's context window."""
    budget = context_window - max_new_tokens
    if budget < 1:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt "
            f"in a {context_window}-token context window"
        )
    return budget


def pack(
    question: str,
    retrieved: Sequence[RetrievedChunk],
    *,
    count_tokens: Callable[[str], int],
    budget: int,
    reorder: bool = False,
    cite: bool = False,
) -> PackedPrompt:
    """Fit as many of the best chunks as the budget allows; `count_tokens` measures a whole prompt
    the way the model will see it (chat template included)."""

    def arranged(n: int) -> list[RetrievedChunk]:
        kept = list(retrieved[:n])
        return long_context_reorder(kept) if reorder else kept

    def tokens(n: int) -> int:
        return count_tokens(render_prompt(question, arranged(n), cite=cite))

    empty = tokens(0)
    if empty > budget:
        raise ValueError(
            f"The question alone takes {empty} prompt tokens, more than the budget of {budget}; "
            "shorten the question or lower max_new_tokens"
        )
    # Prompt length grows with every chunk added, so the largest count that fits is found by bisection.
    low, high, low_tokens = 0, len(retrieved), empty
    while low < high:
        middle = (low + high + 1) // 2
        middle_tokens = tokens(middle)
        if middle_tokens <= budget:
            low, low_tokens = middle, middle_tokens
        else:
            high = middle - 1
    documents = arranged(low)
    prompt, spans = render_prompt_with_spans(question, documents, cite=cite)
    return PackedPrompt(
        prompt=prompt,
        documents=documents,
        dropped=list(retrieved[low:]),
        prompt_tokens=low_tokens,
        budget=budget,
        reordered=reorder,
        document_spans=spans,
    )


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()
