"""Answer a question from an index: retrieve, pack, generate, and map citations back to sources."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rag_mspoe.calibrated.measured_losses import warn_measured_loss
from rag_mspoe.pipelines.packing import PackedPrompt, pack, prompt_budget
from rag_mspoe.pipelines.retrieval import DEFAULT_TOP_K, RetrievedChunk, Retriever

DEFAULT_MAX_NEW_TOKENS = 128

# "[Document 3]", "Document [3]", "Document 3" and a bare "[3]" all cite the third document.
_CITATION = re.compile(r"\[?\bDocuments?\s*\[?\s*(\d+)\s*\]?|\[(\d+)\]", flags=re.IGNORECASE)


class GenerationResultLike(Protocol):
    @property
    def text(self) -> str: ...

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def completion_tokens(self) -> int: ...

    @property
    def finish_reason(self) -> str: ...

    @property
    def method(self) -> str: ...


class GenerationEngine(Protocol):
    """The part of `rag_mspoe.engine.Engine` that answering uses."""

    @property
    def context_window(self) -> int: ...

    @property
    def name(self) -> str: ...

    def count_tokens(self, prompt: Any) -> int: ...

    def generate(self, prompt: Any, **options: Any) -> GenerationResultLike: ...


@dataclass(frozen=True)
class Citation:
    number: int  # the i of [Document i]
    source: str
    title: str
    start: int  # character offsets of the chunk in the source's text
    end: int
    location: str | None
    chunk_id: int


@dataclass
class Answer:
    question: str
    text: str
    citations: list[Citation]
    unknown_citations: list[int]  # document numbers cited that were not in the prompt
    packed: PackedPrompt
    method: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: dict[str, float] = field(default_factory=dict)  # seconds: retrieve, pack, generate


def parse_citations(
    text: str, documents: Sequence[RetrievedChunk], read: Sequence[int] | None = None
) -> tuple[list[Citation], list[int]]:
    """Map the document numbers cited in `text` to the packed chunks, in order of first mention.

    `read`: when a method rewrote the prompt (reordered its documents, or kept only some), the
    index of the packed chunk behind each document the model read, in its order; the answer's
    numbers are those of the prompt it read (a document read again keeps the number of its first
    reading). Returns (citations, numbers that name no document).
    """
    numbered = list(documents) if read is None else [documents[k] for k in dict.fromkeys(read)]
    citations: list[Citation] = []
    unknown: list[int] = []
    seen: set[int] = set()
    for match in _CITATION.finditer(text):
        number = int(match.group(1) or match.group(2))
        if number in seen:
            continue
        seen.add(number)
        if not 1 <= number <= len(numbered):
            unknown.append(number)
            continue
        item = numbered[number - 1]
        chunk = item.chunk
        citations.append(
            Citation(number, chunk.source, chunk.title, chunk.start, chunk.end, chunk.location, item.chunk_id)
        )
    return citations, unknown


def answer_question(
    question: str,
    retriever: Retriever,
    engine: GenerationEngine,
    *,
    k: int = DEFAULT_TOP_K,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    reorder: bool = False,
    cite: bool = True,
    **generate_options: Any,
) -> Answer:
    """Retrieve k chunks for `question` and answer from them.

    `generate_options` go to `engine.generate` (method, temperature, seed, stop...); a method
    left out is the engine's own default.
    """
    started = time.perf_counter()
    retrieved = retriever.retrieve(question, k)
    retrieved_at = time.perf_counter()
    packed = pack_for_engine(
        question, retrieved, engine, max_new_tokens=max_new_tokens, reorder=reorder, cite=cite
    )
    packed_at = time.perf_counter()
    answer = generate_answer(packed, question, engine, max_new_tokens=max_new_tokens, **generate_options)
    answer.timings = {"retrieve": retrieved_at - started, "pack": packed_at - retrieved_at, **answer.timings}
    return answer


def pack_for_engine(
    question: str,
    retrieved: Sequence[RetrievedChunk],
    engine: GenerationEngine,
    *,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    reorder: bool = False,
    cite: bool = True,
) -> PackedPrompt:
    """Pack under the engine's context window, leaving room for `max_new_tokens`. LongContextReorder
    (`reorder`) is warned about once where it was measured to lose on the engine's model."""
    if reorder:
        warn_measured_loss(engine.name, "longcontextreorder")
    return pack(
        question,
        retrieved,
        count_tokens=engine.count_tokens,
        budget=prompt_budget(engine.context_window, max_new_tokens),
        reorder=reorder,
        cite=cite,
    )


def generate_answer(
    packed: PackedPrompt,
    question: str,
    engine: GenerationEngine,
    *,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    **generate_options: Any,
) -> Answer:
    """Generate from an already packed prompt (one packing can serve several methods)."""
    started = time.perf_counter()
    result = engine.generate(packed.prompt, max_new_tokens=max_new_tokens, **generate_options)
    generate_seconds = time.perf_counter() - started
    text = result.text.strip()
    # Another engine than ours may not say what it read: then the prompt is read as packed.
    citations, unknown = parse_citations(text, packed.documents, getattr(result, "documents_read", None))
    return Answer(
        question=question,
        text=text,
        citations=citations,
        unknown_citations=unknown,
        packed=packed,
        method=result.method,
        finish_reason=result.finish_reason,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        timings={"generate": generate_seconds},
    )
