"""Evaluation methods: what a sweep compares, side by side, and the models they run on.

Specs resolve with the core's method-spec language (rag_mspoe.method_spec), re-exported here:

    resolve("layerwise+pi")           # layer-wise factors on top of uniform PI
    resolve("dynamic-ntk:2+layerwise")  # a RoPE-type model variant plus per-call hooks
    resolve("cal=runs/cal/method.json")  # a calibrated config under its own label

This module adds what only evaluation needs: RoPE-type model variants (`rope_variant`,
`EngineSet`), seeds that agree across processes, and the check for document orders.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from rag_mspoe.method_spec import ResolvedMethod, known_names, resolve, resolve_all
from rag_mspoe.rope.variants import rope_variant

# The evaluation modules' name for a resolved method: the same class.
EvalMethod = ResolvedMethod

__all__ = [
    "EngineSet",
    "EvalMethod",
    "known_names",
    "require_given_order",
    "resolve",
    "resolve_all",
    "rope_variant",
    "stable_seed",
]


def require_given_order(methods: Sequence[EvalMethod], where: str) -> None:
    """Refuse document-order methods where there is no list of retrieved documents to reorder."""
    reordering = [m.name for m in methods if m.order != "given"]
    if reordering:
        raise ValueError(f"{reordering} reorder retrieved documents, which means nothing {where}; drop them.")


def stable_seed(*parts: object) -> int:
    """A seed from any values, the same in every process (Python's hash() is salted per process)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big")


class EngineSet:
    """The base model, its RoPE variants and an engine over each, built on first use and kept."""

    def __init__(self, model: Any, tokenizer: Any, make_engine: Callable[[Any, Any], Any] | None = None):
        from rag_mspoe.engine import Engine

        self.model = model
        self.tokenizer = tokenizer
        # Eager decoding: on the compiled path each of a run's methods would compile, and past
        # torch's recompile limit (8 by default) decoding turns eager anyway.
        self._make = make_engine or (lambda m, t: Engine(m, t, method="none", compile=False))
        self._models: dict[tuple[tuple[str, Any], ...], Any] = {(): model}
        self._engines: dict[tuple[tuple[str, Any], ...], Any] = {}

    def model_for(self, method: EvalMethod) -> Any:
        if method.rope not in self._models:
            self._models[method.rope] = rope_variant(self.model, method.rope_parameters)
        return self._models[method.rope]

    def engine_for(self, method: EvalMethod) -> Any:
        if method.rope not in self._engines:
            self._engines[method.rope] = self._make(self.model_for(method), self.tokenizer)
        return self._engines[method.rope]
