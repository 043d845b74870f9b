"""A warning when a config answers prompts with a number of documents it was not validated at.

A shipped config records the document counts where held-out questions showed it to help
(`validated_documents` in its JSON). A method tuned on 10-document prompts can do nothing, or harm,
on 3 or 30: the engine still runs it (the user chose it), and says so once per document count.
"""

from __future__ import annotations

import threading
import warnings

from rag_mspoe.methods.method_config import MethodConfig, method_name


class UnvalidatedDocumentCount(UserWarning):
    """A config runs on prompts with a document count outside its `validated_documents`."""


_warned: set[tuple[str, str, int]] = set()
_warned_guard = threading.Lock()


def warn_outside_validated(method: MethodConfig, documents: int, model_name: str) -> None:
    """Warn once per (model, method, document count) when `documents` is not a validated count."""
    counts = method.validated_documents
    if counts is None or documents in counts or documents < 2:
        return  # fewer than two documents: nothing to read apart or reorder
    label = method_name(method)
    with _warned_guard:
        if (model_name, label, documents) in _warned:
            return
        _warned.add((model_name, label, documents))
    validated = ", ".join(str(n) for n in counts)
    warnings.warn(
        f"The method {label!r} for {model_name} was validated on prompts of {validated} documents "
        f"(held-out questions); this prompt has {documents}. It may help less there, or hurt. "
        f"Measure it: `rag-mspoe sweep --model {model_name} --documents {documents} --methods none "
        f"calibrated --data questions.jsonl.gz`, or answer with method='none'. Shown once per "
        "document count.",
        UnvalidatedDocumentCount,
        stacklevel=2,
    )
