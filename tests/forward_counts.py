"""Counting what a model's forwards read during a call, for tests of work saved."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardCounts:
    forwards: int = 0
    tokens: int = 0  # input positions read, over every forward


def counted_forwards(engine: Any, call: Callable[[], Any]) -> tuple[Any, ForwardCounts]:
    """What `call` returns, and how many forwards of the engine's model it took and tokens they read."""
    counts = ForwardCounts()
    forward = engine.model.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        counts.forwards += 1
        # A forward from hidden states (the upper layers of a cut pass) reads their rows.
        counts.tokens += ids.shape[-1] if ids is not None else kwargs["inputs_embeds"].shape[1]
        return forward(*args, **kwargs)

    engine.model.forward = counted
    try:
        return call(), counts
    finally:
        del engine.model.forward
