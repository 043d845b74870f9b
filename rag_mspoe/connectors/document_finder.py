"""Where the documents are in a prompt a LangChain or LlamaIndex chain built, for methods that read them.

A chain stuffs its retrieved documents into a prompt template (`"\\n\\n".join(doc.page_content ...)`
in LangChain's tutorial, LlamaIndex's `context_str`), so the prompt the model gets says nothing
about where one document ends and the next begins. The retrievers do know: the adapters listen to
them (a LangChain callback, a LlamaIndex event handler) and keep the texts of the documents
retrieved in this process. `locate_documents` then finds those texts in the messages, in the
order they were written, and marks them as the message's documents.

A prompt that already says where its documents are ('Document [i]' lines, explicit
`document_spans`) is left as it is. A prompt in which no document is found is answered as a
prompt without documents (the method has nothing to read or reorder, so the answer is the
unmodified model's), with one warning per process and `documents_read: []` in the response.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rag_mspoe.engine import GenerationResult
from rag_mspoe.methods.validated_documents import NoQuestionAfterDocuments
from rag_mspoe.prompts.chat_template import DOCUMENT_SPANS
from rag_mspoe.prompts.document_prompts import (
    find_document_lines,
    question_follows_documents,
    text_after_documents,
)

Span = tuple[int, int]

# Shorter texts ('Yes', a title) would be found in prompts they were never stuffed into.
MIN_DOCUMENT_CHARS = 12
CAPACITY = 4096  # texts kept: many requests' retrievals, bounded memory


class NoDocumentsFound(UserWarning):
    """A method that reads documents found none in the prompt, so the unmodified model answered."""


class RetrievedTexts:
    """The texts of the documents retrieved in this process, the newest `capacity` kept."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._texts: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def add(self, texts: Iterable[str]) -> None:
        with self._lock:
            for text in texts:
                text = text.strip()
                if len(text) < MIN_DOCUMENT_CHARS:
                    continue
                # As Python writes it inside a list's repr, where some templates put their chunks
                # (LlamaIndex's simple_summarize): line breaks and quotes escaped.
                for form in (text, repr(text)[1:-1]):
                    self._texts[form] = None
                    self._texts.move_to_end(form)
            while len(self._texts) > self._capacity:
                self._texts.popitem(last=False)

    def spans_in(self, content: str) -> list[Span]:
        """The character span of each retrieved text found in `content`, in order, none overlapping:
        where two overlap the one starting first wins, the longer at the same start (a node's text
        with its metadata header over the bare text)."""
        with self._lock:
            texts = list(self._texts)
        found = []
        for text in texts:
            start = content.find(text)
            while start >= 0:
                found.append((start, start + len(text)))
                start = content.find(text, start + len(text))
        chosen: list[Span] = []
        for start, end in sorted(found, key=lambda span: (span[0], -span[1])):
            if not chosen or start >= chosen[-1][1]:
                chosen.append((start, end))
        return chosen

    def clear(self) -> None:
        with self._lock:
            self._texts.clear()


RETRIEVED = RetrievedTexts()


@dataclass(frozen=True)
class LocatedPrompt:
    """A prompt whose documents are marked, and how many were found (None: the method reads none,
    so nothing was looked for)."""

    messages: list[dict[str, Any]]
    documents: int | None


def locate_documents(messages: Sequence[Mapping[str, Any]], method: Any) -> LocatedPrompt:
    """The messages with `document_spans` on those holding retrieved documents, when `method` reads
    documents and the prompt does not already say where they are (see the module docstring)."""
    converted = [dict(message) for message in messages]
    if method is None or not method.needs_document_spans():
        return LocatedPrompt(converted, None)
    said = [_said_spans(message) for message in converted]
    if not any(spans is not None for spans in said):
        said = [RETRIEVED.spans_in(m["content"]) if _readable(m) else None for m in converted]
        for message, spans in zip(converted, said, strict=True):
            if spans:
                message[DOCUMENT_SPANS] = [list(span) for span in spans]
    found = sum(len(spans or []) for spans in said)
    # "auto" reads such a prompt unmodified (applies_at says so), and the engine says why.
    asks_before = found and method.rewrites_prompt() and not question_follows_documents(converted)
    if asks_before and method.applies_at(found, question_follows=False):
        _warn_no_question_after(converted, method)
    if not found:
        if method.applies_at(0):  # "auto" expects nothing of a prompt without documents
            _warn_once(
                NoDocumentsFound,
                f"{_name(method)} reads the prompt's documents, and this prompt holds none that a "
                "retriever returned in this process nor 'Document [i]' lines, so the unmodified model "
                "answered (the response says documents_read: []). Retrieve the documents with a "
                "LangChain or LlamaIndex retriever in the same process, or format them with "
                "rag_mspoe.connectors.format_documents. Said once per process.",
            )
        last = next((m for m in reversed(converted) if _readable(m)), None)
        if last is not None:
            last[DOCUMENT_SPANS] = []  # says: no documents, so the engine answers unmodified
    return LocatedPrompt(converted, found)


def with_documents_read(result: GenerationResult, located: LocatedPrompt) -> GenerationResult:
    """The result saying, for a method that reads documents, which given document each one the
    model read was, in its order: the reordering's order, else the order given ([] when none were
    found). Results of other methods are returned as they are."""
    if result.documents_read is not None or located.documents is None:
        return result
    return dataclasses.replace(result, documents_read=tuple(range(located.documents)))


def _warn_no_question_after(messages: Sequence[Mapping[str, Any]], method: Any) -> None:
    after = text_after_documents(messages) or ""
    _warn_once(
        NoQuestionAfterDocuments,
        f"{_name(method)} ranks the documents by the text that follows them, and only "
        f"{after.strip()!r} follows them in this prompt, so its ranking is close to a guess. Put the "
        "question after the context in the prompt template (as LlamaIndex's templates and the "
        "lost-in-the-middle benchmark do): '...Context: {context}\nQuestion: {question}\nAnswer:'. "
        "Said once per process.",
    )


def _said_spans(message: Mapping[str, Any]) -> list[Span] | None:
    if message.get(DOCUMENT_SPANS) is not None:
        return [tuple(span) for span in message[DOCUMENT_SPANS]]  # type: ignore[misc]
    return find_document_lines(message["content"]) if _readable(message) else None


def _readable(message: Mapping[str, Any]) -> bool:
    return message.get("role") in ("user", "system") and isinstance(message.get("content"), str)


_warned: set[type[Warning]] = set()


def _warn_once(category: type[Warning], message: str) -> None:
    if category in _warned:
        return
    _warned.add(category)
    warnings.warn(message, category, stacklevel=4)


def _name(method: Any) -> str:
    from rag_mspoe import method_name

    return method_name(method)
