"""Warnings when a config meets prompts unlike those it was validated on.

A shipped config records the document counts where held-out questions showed it to help
(`validated_documents` in its JSON). A method tuned on 10-document prompts can do nothing, or harm,
on 3 or 30: the engine still runs it when the user chose it, and says so once per document count;
"auto" leaves it out there, and says that once per document count. Every validation asked its
question after the documents, and the shipped reorderings rank the documents by the text after
them: "auto" leaves out a prompt whose documents no question follows (LangChain's hub prompt
rlm/rag-prompt asks before its context), and says that once per model.
"""

from __future__ import annotations

import threading
import warnings

from rag_mspoe.methods.method_config import MethodConfig, method_name


class UnvalidatedDocumentCount(UserWarning):
    """A config runs on prompts with a document count outside its `validated_documents`."""


class NoQuestionAfterDocuments(UserWarning):
    """A reordering ranks the documents by the text that follows them, and little follows them."""


_warned: set[tuple[str, str, int]] = set()
_warned_guard = threading.Lock()


def warn_outside_validated(method: MethodConfig, documents: int, model_name: str) -> None:
    """Warn once per (model, method, document count) when `documents` is not a validated count."""
    counts = method.validated_documents
    if counts is None or not _first_time(method, documents, model_name):
        return
    validated = ", ".join(str(n) for n in counts)
    label = method_name(method)
    warnings.warn(
        f"The method {label!r} for {model_name} was validated on prompts of {validated} documents "
        f"(held-out questions); this prompt has {documents}. It may help less there, or hurt. "
        f"Measure it: `rag-mspoe sweep --model {model_name} --documents {documents} --methods none "
        f"calibrated --data questions.jsonl.gz`, or answer with method='none'. Shown once per "
        "document count.",
        UnvalidatedDocumentCount,
        stacklevel=2,
    )


def note_left_out(method: MethodConfig, documents: int, model_name: str) -> None:
    """Say once per (model, document count) that "auto" answered without `method`, and why."""
    counts = method.validated_documents
    if counts is None or not _first_time(method, documents, model_name, "auto"):
        return
    validated = ", ".join(str(n) for n in counts[:-1]) + " or " * (len(counts) > 1) + str(counts[-1])
    warnings.warn(
        f"method='auto' answered a prompt of {documents} documents with the unmodified model: the "
        f"method shipped for {model_name} was validated on prompts of {validated} documents only "
        f"(held-out questions). Retrieve {validated} documents for it to apply (k= in a retriever), "
        "or pass method='calibrated' to apply it anyway. Shown once per document count.",
        UnvalidatedDocumentCount,
        stacklevel=2,
    )


def note_no_question_after(method: MethodConfig, after: str, model_name: str) -> None:
    """Say once per model that "auto" answered without `method` a prompt whose documents only
    `after` follows."""
    if not _once((model_name, f"auto: {method_name(method)}, no question after", 0)):
        return
    warnings.warn(
        f"method='auto' answered a prompt with the unmodified model: only {after.strip()!r} follows "
        f"its documents, and the method shipped for {model_name} ranks them by the question after "
        "them (the layout it was validated on). Put the question after the context in the prompt "
        "template: '...Context: {context}\nQuestion: {question}\nAnswer:' (LangChain's hub prompt "
        "rlm/rag-prompt asks before its context; LlamaIndex's templates ask after), or pass "
        "method='calibrated' to apply it anyway. Shown once.",
        NoQuestionAfterDocuments,
        stacklevel=2,
    )


def _first_time(method: MethodConfig, documents: int, model_name: str, asked: str = "") -> bool:
    """Whether this is the first unvalidated `documents` seen for the model and method (as asked);
    fewer than two documents never count: there is nothing to read apart or reorder."""
    if method.validated_documents is None or documents in method.validated_documents or documents < 2:
        return False
    return _once((model_name, asked or method_name(method), documents))


def _once(key: tuple[str, str, int]) -> bool:
    with _warned_guard:
        if key in _warned:
            return False
        _warned.add(key)
    return True
