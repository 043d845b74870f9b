"""Pack retrieved chunks into a prompt in the lost-in-the-middle QA format, under a token budget.

Chunks go into the prompt in the order given (retrieval order, best first), numbered
`Document [1]`, `Document [2]`, ... When they do not all fit, chunks are dropped from the
bottom of that order and returned in `PackedPrompt.dropped`. `LongContextReorder` (best
chunks at both ends, weakest in the middle) is applied only when asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rag_mspoe.pipelines.retrieval import RetrievedChunk
from rag_mspoe.prompts.document_order import long_context_reorder
from rag_mspoe.prompts.document_prompts import document_message
from rag_mspoe.prompts.qa_prompt import render_qa_prompt


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


def render_prompt(question: str, documents: Sequence[RetrievedChunk], *, cite: bool = False) -> str:
    return render_prompt_with_spans(question, documents, cite=cite)[0]


def render_prompt_with_spans(
    question: str, documents: Sequence[RetrievedChunk], *, cite: bool = False
) -> tuple[str, list[tuple[int, int]]]:
    """The prompt and the character span of each document's line in it."""
    return render_qa_prompt(question, [(item.chunk.title, item.chunk.text) for item in documents], cite=cite)


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
