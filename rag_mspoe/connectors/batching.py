"""Cross-request batching for the server: greedy requests that wait together share one forward.

Requests with equal settings (method, max tokens, stop strings, ...) that are waiting at the same
time run as one left-padded batch; a request that arrives while a batch runs joins the next one.
Sampled requests (temperature > 0) run alone, since a batch would draw other random numbers than
a request alone.

Non-streamed requests run through `Engine.generate_batch`; a batch holding a request that fails
(a prompt over the context window, say) is rerun one request at a time, so each gets its own
answer or error. Streamed requests run through `Engine.run_streams`, with streamed requests
only: each stream gets its pieces as they are generated and closes as soon as its own answer
ends; a reader who leaves drops out of the batch at the next token. Their prompts are checked
before they join (a prompt too long fails alone, before its stream starts), so what can still
fail a streamed batch is the model itself, and that error goes to each of its streams.

In bf16 a padded batch can pick another token than the same prompt alone after a few dozen
tokens (rounding differs with the padding); that is why batching is off unless asked for.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from rag_mspoe.engine import Engine, GenerationResult
from rag_mspoe.engine.engine_generation import StreamRequest
from rag_mspoe.engine.text_stream import AsyncTextStream, StreamOutlet

Item = tuple[Any, "asyncio.Future[GenerationResult]", threading.Event | None]  # prompt, answer, cancel
StreamItem = tuple[StreamRequest, StreamOutlet]


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
        # Waiting requests by their settings; streamed and non-streamed ones apart.
        self._waiting: dict[tuple[bool, str], tuple[dict[str, Any], list[Any]]] = {}
        self._worker: asyncio.Task[None] | None = None

    async def generate(
        self, prompt: Any, options: dict[str, Any], cancel: threading.Event | None = None
    ) -> GenerationResult:
        """The answer to one request, batched with others when that is allowed.

        Setting `cancel` gives up on a request that runs alone; cancelling the awaiting task takes
        a request out of a batch that has not started (one that has runs to its end, for the others).
        """
        if not self._batched(options):
            return await self.engine.agenerate(prompt, cancel=cancel, **options)
        future: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()
        self._enqueue(False, options, (prompt, future, cancel))
        return await future

    def stream(self, prompt: Any, options: dict[str, Any]) -> AsyncTextStream:
        """A streamed answer to one request, batched with other streamed requests when allowed.

        A bad prompt raises here, before the stream starts (as `Engine.astream`); must be called
        inside a running event loop."""
        if not self._batched(options):
            return self.engine.astream(prompt, **options)
        request = self.engine.prepare_stream(prompt, **options)
        return AsyncTextStream(
            lambda put, cancel: self._enqueue(True, options, (request, StreamOutlet(put, cancel)))
        )

    def _batched(self, options: dict[str, Any]) -> bool:
        return self.max_batch_size > 1 and not options.get("temperature", 0.0) > 0

    def _enqueue(self, streamed: bool, options: dict[str, Any], item: Item | StreamItem) -> None:
        key = streamed, repr(sorted(options.items()))  # configs are dataclasses, lists included: not hashable
        self._waiting.setdefault(key, (options, []))[1].append(item)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())

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
            if key[0]:
                streams = [item for item in batch if not item[1].cancel.is_set()]  # reader still there
                if streams:
                    await self._run_streams(streams)
                continue
            live = [item for item in batch if not item[1].done()]  # not cancelled
            if live:
                await self._run(options, live)

    async def _run_streams(self, items: list[StreamItem]) -> None:
        requests, outlets = [request for request, _ in items], [outlet for _, outlet in items]
        try:
            await asyncio.to_thread(self.engine.run_streams, requests, outlets)  # delivers its errors
        except Exception as exc:  # refused before it started: each stream learns why, the queue goes on
            for outlet in outlets:
                outlet.put(exc)
            return
        if len(items) > 1:
            self.batches += 1
            self.batched_requests += len(items)

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
