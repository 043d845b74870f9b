"""What the framework adapters share: per-call settings over instance fields, and retries.

Kept free of LangChain and LlamaIndex imports, so each adapter needs only its own extra.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from rag_mspoe.engine import GenerationTimeout

# Settings a single call may override, by the names the adapters use for their fields.
PER_CALL_SETTINGS = ("temperature", "max_tokens", "top_p", "seed", "stop", "method", "truncate", "timeout")

T = TypeVar("T")


def engine_settings(adapter: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """Engine keyword arguments for one call: the overrides given, else the adapter's fields."""
    unknown = sorted(set(overrides) - set(PER_CALL_SETTINGS))
    if unknown:
        raise TypeError(
            f"Unknown call argument(s) {unknown}; per-call settings are: {list(PER_CALL_SETTINGS)}."
        )
    value = {
        name: overrides[name] if name in overrides else getattr(adapter, name) for name in PER_CALL_SETTINGS
    }
    value["max_new_tokens"] = value.pop("max_tokens")
    return value


def retrying(call: Callable[[], T], max_retries: int) -> T:
    """Run call, again up to max_retries times while it times out."""
    for _ in range(max_retries):
        try:
            return call()
        except GenerationTimeout:
            continue
    return call()


async def aretrying(call: Callable[[], Awaitable[T]], max_retries: int) -> T:
    for _ in range(max_retries):
        try:
            return await call()
        except GenerationTimeout:
            continue
    return await call()
