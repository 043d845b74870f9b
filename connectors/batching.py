"""Cross-request batching for the server: greedy requests that wait together share one forward.

Requests with equal settings (method, max tokens, stop strings, ...) that are waiting at the same
time run as one left-padded batch through `Engine.generate_batch`; a request that arrives while
a batch runs joins the next one. Sampled requests (temperature > 0) run alone, since a batch
would draw other random numbers than a request alone. A batch holding a request that fails (a
prompt over the context window, say) is rerun one request at a time, so each gets its own
answer or error.

In bf16 a padded batch can pick another token than the same prompt alone after a few dozen
tokens (rounding differs with the padding); that is why batching is off unless asked for.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from rag_mspoe.engine import Engine, GenerationResult

Item = tuple[Any, "asyncio.Future[GenerationResult]", threading.Event | None]  # prompt, answer, cancel


class RequestBatcher:
    """Collects requests for up to `max_wait_s`, then runs them in batches of `max_batch_size`."""

    def __init__(self, engine: Engine, max_batch_size: int = 1, max_wait_s: float = 0.01) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}.")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must not be negative, got {max_wait_s}.")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.batches = 0  # batches of two or more requests run so far
        self.batched_requests = 0  # requests answered in those batches
        self._waiting: dict[str, tuple[dict[str, Any], list[Item]]] = {}
        self._worker: asyncio.Task[None] | None = None

    async def generate(
        self, prompt: Any, options: dict[str, Any], cancel: threading.Event | None = None
    ) -> GenerationResult:
        """The answer to one request, batched with others when that is allowed.

        Setting `cancel` gives up on a request that runs alone; cancelling the awaiting task takes
        a request out of a batch that has not started (one that has runs to its end, for the others).
        """
        if self.max_batch_size == 1 or options.get("temperature", 0.0) > 0:
            return await self.engine.agenerate(prompt, cancel=cancel, **options)
        future: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()
        key = repr(sorted(options.items()))  # configs are dataclasses, lists included: not hashable
        self._waiting.setdefault(key, (options, []))[1].append((prompt, future, cancel))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await future

    def stats(self) -> dict[str, int]:
        return {
            "max_batch_size": self.max_batch_size,
            "batches": self.batches,
            "batched_requests": self.batched_requests,
        }

    async def _drain(self) -> None:
        await asyncio.sleep(self.max_wait_s)  # requests sent together arrive a little apart
        while self._waiting:
            key, (options, items) = next(iter(self._waiting.items()))
            batch, rest = items[: self.max_batch_size], items[self.max_batch_size :]
            if rest:
                self._waiting[key] = (options, rest)
            else:
                del self._waiting[key]
            live = [item for item in batch if not item[1].done()]  # not cancelled
            if live:
                await self._run(options, live)

    async def _run(self, options: dict[str, Any], items: list[Item]) -> None:
        if len(items) == 1:
            await self._answer_alone(options, items[0])
            return
        try:
            results = await self.engine.agenerate_batch([prompt for prompt, _, _ in items], **options)
        except Exception:
            for item in items:
                await self._answer_alone(options, item)
            return
        self.batches += 1
        self.batched_requests += len(items)
        for (_, future, _), result in zip(items, results, strict=True):
            if not future.done():
                future.set_result(result)

    async def _answer_alone(self, options: dict[str, Any], item: Item) -> None:
        prompt, future, cancel = item
        try:
            result = await self.engine.agenerate(prompt, cancel=cancel, **options)
        except Exception as exc:
            if not future.done():
                future.set_exception(exc)
            return
        if not future.done():
            future.set_result(result)
