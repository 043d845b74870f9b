"""What the chat and text completion routes share: a request's body and settings within the
server's limits, and its answer run on the engine (through the batcher), given up when the client
goes away, with the engine's errors told to the client as what to change."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from pydantic import ValidationError

from rag_mspoe.connectors import openai_schema as schema
from rag_mspoe.connectors.batching import RequestBatcher
from rag_mspoe.connectors.document_finder import LocatedPrompt, locate_documents
from rag_mspoe.connectors.server_errors import ApiError, client_errors, invalid_request
from rag_mspoe.connectors.server_models import ModelRoutes
from rag_mspoe.connectors.server_streams import disconnected
from rag_mspoe.engine import ENGINE_DEFAULT, Engine
from rag_mspoe.engine.text_stream import AsyncTextStream

DEFAULT_MAX_TOKENS = 256
T = TypeVar("T")


async def read_body(request: Request, model_cls: type[schema._CompletionParams]) -> Any:
    raw = await request.body()  # size and deadline already checked by the guard
    try:
        return model_cls.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        raise invalid_request(exc) from exc


@dataclass(frozen=True)
class RequestRunner:
    """Runs requests on the one engine, within the server's limits."""

    engine: Engine
    batcher: RequestBatcher
    routes: ModelRoutes
    max_tokens_limit: int
    request_timeout_s: float | None

    def settings(self, body: schema._CompletionParams, raw: bool) -> dict[str, Any]:
        """The engine's options for a request: its method (from the model name), sampling, limits."""
        requested = body.requested_tokens()
        if requested is not None and requested > self.max_tokens_limit:
            raise ApiError(
                400,
                f"max_tokens={requested} is over this server's limit of {self.max_tokens_limit}.",
                param="max_tokens",
            )
        method = self.routes.method_for(body.model)
        return {
            "max_new_tokens": requested or min(DEFAULT_MAX_TOKENS, self.max_tokens_limit),
            "temperature": body.sampling_temperature(),
            "top_p": body.top_p,
            "stop": body.stop,
            "seed": body.seed,
            "raw": raw,
            "timeout": self.request_timeout_s,
            "method": method,
            "logprobs": body.logprob_alternatives(),
        }

    def client_errors(
        self, prompt_field: str, tools: bool = False
    ) -> contextlib.AbstractContextManager[None]:
        """`server_errors.client_errors` for this engine and deadline."""
        return client_errors(prompt_field, self.engine, self.request_timeout_s, tools)

    def with_documents_located(
        self, messages: list[dict[str, Any]], options: dict[str, Any]
    ) -> LocatedPrompt:
        """The messages, with a method that reads documents told where they are, or that there are
        none: a chat without documents is answered (`rag_mspoe.connectors.document_finder`)."""
        spec = options["method"]
        return locate_documents(messages, self.engine.method if spec is ENGINE_DEFAULT else spec)

    def open_stream(self, prompt: Any, options: dict[str, Any], prompt_field: str) -> AsyncTextStream:
        with self.client_errors(prompt_field):
            return self.batcher.stream(prompt, options)

    async def answer(
        self,
        request: Request,
        start: Callable[[threading.Event], Awaitable[T]],
        prompt_field: str,
        tools: bool = False,
    ) -> T:
        """One non-streamed answer, given up (its generation cancelled) if the client disconnects first.

        start: begins the generation, which stops once the event it is handed is set."""

        async def run(cancel: threading.Event) -> T:
            with self.client_errors(prompt_field, tools):
                return await start(cancel)

        cancel = threading.Event()
        work = asyncio.ensure_future(run(cancel))
        gone = asyncio.ensure_future(disconnected(request))
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                cancel.set()
                work.cancel()
        if work not in done:
            raise ApiError(
                499, "The client closed the connection before the answer was ready.", code="client_closed"
            )
        return work.result()
