"""Streaming helpers of the server: server-sent events, several answers streamed side by side,
and noticing a client that went away."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from rag_mspoe.connectors import openai_schema as schema
from rag_mspoe.connectors.request_guard import UNEXPECTED
from rag_mspoe.connectors.server_errors import timed_out
from rag_mspoe.engine import GenerationResult, GenerationTimeout
from rag_mspoe.engine.text_stream import AsyncTextStream, TextPiece

# The server logs under one name, whichever of its modules writes.
logger = logging.getLogger("rag_mspoe.connectors.server")


async def disconnected(request: Request) -> None:
    """Returns once the client has gone away (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def includes_usage(body: schema._CompletionParams) -> bool:
    """Whether a streamed answer ends with a chunk of token counts (stream_options.include_usage)."""
    return bool(body.stream_options and body.stream_options.include_usage)


def sse(
    events: Callable[[], AsyncIterator[dict[str, Any]]], request_timeout_s: float | None
) -> StreamingResponse:
    """The events as server-sent events, ending in [DONE]; an error midway is the last event."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events():
                yield f"data: {json.dumps(event)}\n\n"
        except Exception as exc:  # the status line is sent already: report in the stream
            if isinstance(exc, GenerationTimeout):
                error = timed_out(request_timeout_s).body
            else:
                logger.exception("Generation failed inside a stream")
                error = schema.error_body(UNEXPECTED, "server_error")
            yield f"data: {json.dumps(error)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def interleaved(
    streams: Sequence[AsyncTextStream],
) -> AsyncIterator[tuple[int, TextPiece | GenerationResult]]:
    """(index, piece) from several streams as each piece arrives, then (index, result) once that
    stream has ended. An error in any stream ends them all and is raised."""
    queue: asyncio.Queue[tuple[int, TextPiece | GenerationResult] | BaseException] = asyncio.Queue()

    async def drain(index: int, stream: AsyncTextStream) -> None:
        try:
            async for piece in stream:
                await queue.put((index, piece))
            assert stream.result is not None
            await queue.put((index, stream.result))
        except BaseException as exc:  # handed to the reader, which raises it
            await queue.put(exc)

    tasks = [asyncio.ensure_future(drain(index, stream)) for index, stream in enumerate(streams)]
    try:
        ended = 0
        while ended < len(streams):
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            ended += isinstance(item[1], GenerationResult)
            yield item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()
