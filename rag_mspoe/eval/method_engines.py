"""The models and engines a run's methods need, once each, and what evaluation adds to a method.

Methods arrive resolved by the core's spec language (rag_mspoe.methods.method_spec). A method with a
transformers RoPE type runs on a model variant sharing the weights (rag_mspoe.rope.variants);
`EngineSet` builds each variant and its engine on first use. Also: seeds that agree across
processes, and the refusal of document orders where there are no documents to reorder.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from rag_mspoe.methods.method_spec import ResolvedMethod
from rag_mspoe.rope.variants import rope_variant

if TYPE_CHECKING:
    from rag_mspoe.engine.protocol import EngineLike
    from rag_mspoe.engine.remote_engine import RemoteEngine


def require_given_order(methods: Sequence[ResolvedMethod], where: str) -> None:
    """Refuse document-order methods where there is no list of retrieved documents to reorder."""
    reordering = [m.name for m in methods if m.order != "given"]
    if reordering:
        raise ValueError(f"{reordering} reorder retrieved documents, which means nothing {where}; drop them.")


def stable_seed(*parts: object) -> int:
    """A seed from any values, the same in every process (Python's hash() is salted per process)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big")


class Engines(Protocol):
    """Where a run's scorer gets the engine of each method: `EngineSet` here, or the one engine of a
    model on a server (`rag_mspoe.eval.sweep.remote.RemoteEngines`)."""

    def engine_for(self, method: ResolvedMethod) -> EngineLike | RemoteEngine: ...


class EngineSet:
    """The base model, its RoPE variants and an engine over each, built on first use and kept."""

    def __init__(
        self, model: Any, tokenizer: Any, make_engine: Callable[[Any, Any], EngineLike] | None = None
    ):
        from rag_mspoe.engine import Engine

        self.model = model
        self.tokenizer = tokenizer
        # Eager decoding: on the compiled path each of a run's methods would compile, and past
        # torch's recompile limit (8 by default) decoding turns eager anyway.
        self._make = make_engine or (lambda m, t: Engine(m, t, method="none", compile=False))
        self._models: dict[tuple[tuple[str, Any], ...], Any] = {(): model}
        self._engines: dict[tuple[tuple[str, Any], ...], EngineLike] = {}

    def model_for(self, method: ResolvedMethod) -> Any:
        if method.rope not in self._models:
            self._models[method.rope] = rope_variant(self.model, method.rope_parameters)
        return self._models[method.rope]

    def engine_for(self, method: ResolvedMethod) -> EngineLike:
        if method.rope not in self._engines:
            self._engines[method.rope] = self._make(self.model_for(method), self.tokenizer)
        return self._engines[method.rope]
