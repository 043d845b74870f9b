"""Text pieces of one generation as a worker thread produces them: one stream, iterated with
`for` or `async for`."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from rag_mspoe.engine.engine_types import GenerationResult
from rag_mspoe.engine.token_logprobs import TokenLogprob

# How a stream's owner starts the worker: it gets the stream's `put` and its cancel event.
Start = Callable[[Callable[[object], None], threading.Event], None]


@dataclass(frozen=True)
class StreamOutlet:
    """Where one stream's worker delivers: `put` takes text pieces, then `End` or an exception;
    `cancel` is set once the reader has gone."""

    put: Callable[[object], None]
    cancel: threading.Event


class TextPiece(str):
    """A streamed piece of text; `tokens` are the generated tokens that start in it, with their
    log-probabilities, when the call asked for them (`logprobs=`), else empty."""

    tokens: tuple[TokenLogprob, ...]

    def __new__(cls, text: str, tokens: tuple[TokenLogprob, ...] = ()) -> TextPiece:
        piece = super().__new__(cls, text)
        piece.tokens = tokens
        return piece


class End:
    """Marks the end of a stream in its queue, carrying the result."""

    def __init__(self, result: GenerationResult) -> None:
        self.result = result


class _Stream:
    """What both forms share: the result, the cancel event, and what an item from the worker means."""

    def __init__(self) -> None:
        self.result: GenerationResult | None = None
        self._cancel = threading.Event()

    def _piece(self, item: object) -> TextPiece | None:
        """The text an item carries; None at the end (`result` is then set). Raises what the worker raised."""
        if isinstance(item, End):
            self.result = item.result
            return None
        if isinstance(item, BaseException):
            raise item
        return item if isinstance(item, TextPiece) else TextPiece(str(item))

    def close(self) -> None:
        self._cancel.set()

    def __del__(self) -> None:  # a stream dropped unread must not keep the model busy
        self._cancel.set()


class TextStream(_Stream):
    """Text pieces of one generation as they are produced; `.result` is set once it ends.

    Generation runs in a worker thread. Leaving the loop early (or `close()`) stops it at the
    next token.
    """

    def __init__(self, start: Start) -> None:
        super().__init__()
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        start(self._queue.put, self._cancel)

    def __iter__(self) -> Iterator[TextPiece]:
        try:
            while (piece := self._piece(self._queue.get())) is not None:
                yield piece
        finally:
            self._cancel.set()


class AsyncTextStream(_Stream):
    """The async form of `TextStream`: `async for piece in stream`, then `.result`."""

    def __init__(self, start: Start) -> None:
        super().__init__()
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        loop, items, cancel = asyncio.get_running_loop(), self._queue, self._cancel

        def put(item: object) -> None:  # called from the worker thread; holds no reference to self
            try:
                loop.call_soon_threadsafe(items.put_nowait, item)
            except RuntimeError:  # the event loop has closed: nobody is listening any more
                cancel.set()

        start(put, self._cancel)

    async def __aiter__(self) -> AsyncIterator[TextPiece]:
        try:
            while (piece := self._piece(await self._queue.get())) is not None:
                yield piece
        finally:
            self._cancel.set()
