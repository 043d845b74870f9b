"""An OpenAI-compatible HTTP server for the model and its method: chat and text completions, streaming or not.

    rag-mspoe serve --method mspoe            # http://127.0.0.1:8000/v1, model "smollm2-135m-instruct"
    app = create_app(Engine.load())           # or mount the FastAPI app yourself

The request's `model` picks the rescaling method without reloading weights:
"<name>" uses the server's default method, "<name>+<method>" another one ("+none", "+pi",
"+mspoe", ..., "+calibrated" where a calibrated config ships for the model, or a config
registered at start-up with --method-config NAME=PATH).
Every request goes through the one engine, whose lock queues concurrent requests, so answers
under concurrency equal answers one at a time. With max_batch_size > 1, greedy requests with
equal settings that wait together run as one batch (`rag_mspoe.connectors.batching`): more
throughput under load, at the price of bf16 answers that can drift from a request alone.

With `tools`, calls come back in the OpenAI shape; streamed, each call as one `delta.tool_calls`
chunk (index, id, type, name and arguments) once it is written whole, ending in finish_reason
"tool_calls"; an answer max_tokens cuts off ends in "length", without the call it was writing.
Every request first passes `request_guard` (Host, Origin, API key, body size and deadline).
A client that goes away has its generation stopped at the next token, or never started.
`logprobs` (chat: with `top_logprobs`, up to 20 alternatives; completions: up to 5) gives each
answer token's log-probability under the model, before temperature, top_p and a response_format's
grammar; streamed, each chunk carries the tokens that start in its text. With `echo`, the
prompt's own tokens are scored too (`Engine.prompt_logprobs`), as lm-evaluation-harness asks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rag_mspoe.calibrated import calibrated_config_path
from rag_mspoe.connectors import openai_schema as schema
from rag_mspoe.connectors.batching import RequestBatcher
from rag_mspoe.connectors.document_finder import LocatedPrompt, locate_documents, with_documents_read
from rag_mspoe.connectors.request_guard import LOOPBACK_HOSTS, UNEXPECTED, GuardSettings, RequestGuard
from rag_mspoe.engine import (
    ENGINE_DEFAULT,
    Engine,
    EngineDefault,
    GenerationResult,
    GenerationTimeout,
    PromptTooLongError,
)
from rag_mspoe.engine.text_stream import AsyncTextStream, TextPiece
from rag_mspoe.engine.token_logprobs import TokenLogprob, openai_chat_logprobs, openai_text_logprobs
from rag_mspoe.methods import CALIBRATED, NAMED_METHODS, MethodConfig, method_name, parse_method
from rag_mspoe.models.loading import model_display_name
from rag_mspoe.prompts.chat_template import PromptError
from rag_mspoe.prompts.document_prompts import MissingDocumentSpans
from rag_mspoe.tools.tool_calls import AsyncToolStream, ToolAnswer, plan_tools

DEFAULT_MAX_TOKENS = 256
T = TypeVar("T")
logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An error returned to the client in the OpenAI error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.body = status, schema.error_body(message, kind, code, param)


async def disconnected(request: Request) -> None:
    """Returns once the client has gone away (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


ROUTES = "GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions"


def routing_error_body(method: str, path: str, exc: StarletteHTTPException) -> dict[str, Any]:
    if exc.status_code == 404:
        return schema.error_body(f"No route {path!r}; this server has {ROUTES}.", code="not_found")
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return schema.error_body(
            f"{method} is not allowed on {path!r} (allowed: {allowed}); this server has {ROUTES}.",
            code="method_not_allowed",
        )
    return schema.error_body(str(exc.detail), code=str(exc.status_code))


_UNION_TAGS = {"str", "int", "float", "bool"}


def invalid_request(exc: ValidationError) -> ApiError:
    """A 400 naming the first field that is wrong, in words a client can act on."""
    first = exc.errors()[0]
    # Drop the tags pydantic adds for each member of a union ("prompt.str" -> "prompt").
    where = ".".join(str(p) for p in first["loc"] if not (str(p) in _UNION_TAGS or "[" in str(p)))
    if first["type"] == "json_invalid":
        detail = str(first["msg"]).removeprefix("Invalid JSON: ")
        return ApiError(400, f"The request body is not valid JSON: {detail}.")
    if first["type"] == "model_type" and not where:
        return ApiError(400, "The request body must be a JSON object.")
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"Unknown field {where!r}; this server does not support it.", param=where)
    message = str(first["msg"]).removeprefix("Value error, ")
    return ApiError(400, f"Invalid request: {where}: {message}.", param=where or None)


class ModelRoutes:
    """Model names the server answers to, each a method on the one engine."""

    def __init__(self, engine: Engine, extra_methods: dict[str, MethodConfig] | None = None) -> None:
        self.engine = engine
        self.methods: dict[str, MethodConfig | None] = {"none": None}
        named = {name: parse_method(name) for name in NAMED_METHODS}
        self.methods.update({n: m for n, m in named.items() if m is not None})
        if calibrated_config_path(model_display_name(engine.model)) is not None:
            self.methods[CALIBRATED] = engine.method_config(CALIBRATED)  # only where one ships
        self.methods.update(extra_methods or {})

    def names(self) -> list[str]:
        return [self.engine.name] + [f"{self.engine.name}+{name}" for name in self.methods]

    def method_for(self, model: str) -> MethodConfig | None | EngineDefault:
        """The method a model name asks for (None: unmodified); ENGINE_DEFAULT for the server's default."""
        base, plus, suffix = model.partition("+")
        if base != self.engine.name or (plus and suffix not in self.methods):  # "<name>+" is no name
            raise ApiError(
                404,
                f"The model {model!r} does not exist; available: {', '.join(self.names())}.",
                code="model_not_found",
                param="model",
            )
        return self.methods[suffix] if suffix else ENGINE_DEFAULT


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


def create_app(
    engine: Engine,
    *,
    api_key: str | None = None,
    allowed_hosts: Sequence[str] = LOOPBACK_HOSTS,
    cors_origins: Sequence[str] = (),
    extra_methods: dict[str, MethodConfig] | None = None,
    max_tokens_limit: int = 1024,
    max_request_bytes: int = 1 << 20,
    body_timeout_s: float = 30.0,
    request_timeout_s: float | None = 600.0,
    max_batch_size: int = 1,
    batch_wait_ms: float = 10.0,
    health_details: Callable[[], Awaitable[dict[str, Any]]] | None = None,
) -> Any:
    """The FastAPI application serving `engine`.

    api_key: bearer token every /v1 request must carry (None: no key). allowed_hosts: the names
    clients reach the server by (the Host header; loopback names by default, "*" any), which
    blocks DNS rebinding; cors_origins: web pages (origins such as "https://app.example", "*"
    any) allowed to call it from a browser, besides the server's own origin.

    max_request_bytes, body_timeout_s: a request body over this size gets a 413 as soon as it
    passes it, one that takes longer than this to arrive a 408 (`request_guard`).
    request_timeout_s: the deadline of one generation, waiting for the model included (None:
    none); past it a request gets a 503. A client that disconnects has its generation stopped
    at the next token, or never started if it was still waiting.
    max_batch_size: greedy requests with equal settings run together in batches of up to this
    many, streamed ones with streamed ones, those offering tools with those offering the same tools
    (1: one at a time);
    batch_wait_ms: how long the first waits for others to join it.
    health_details: what /health adds (a deployment's other replicas: `ray_serve`)."""
    routes = ModelRoutes(engine, extra_methods)
    batcher = RequestBatcher(engine, max_batch_size, batch_wait_ms / 1000)
    app = FastAPI(title="rag-mspoe", version="1")
    app.add_middleware(
        RequestGuard,
        settings=GuardSettings(
            api_key=api_key,
            allowed_hosts=tuple(allowed_hosts),
            cors_origins=tuple(cors_origins),
            max_request_bytes=max_request_bytes,
            body_timeout_s=body_timeout_s,
        ),
    )
    started = int(time.time())
    bodies, body_schemas = schema.openapi_bodies()
    described = app.openapi

    def openapi() -> dict[str, Any]:
        """FastAPI's document (made once), with the schemas of the bodies the routes read themselves."""
        fresh = app.openapi_schema is None
        document = described()
        if fresh:
            document.setdefault("components", {}).setdefault("schemas", {}).update(body_schemas)
        return document

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown routes and methods in the OpenAI error shape (FastAPI's own is {"detail": ...})."""
        return JSONResponse(
            routing_error_body(request.method, request.url.path, exc),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    async def read_body(request: Request, model_cls: type[schema._CompletionParams]) -> Any:
        raw = await request.body()  # size and deadline already checked by the guard
        try:
            return model_cls.model_validate_json(raw, strict=True)
        except ValidationError as exc:
            raise invalid_request(exc) from exc

    def settings(body: schema._CompletionParams, raw: bool) -> dict[str, Any]:
        requested = body.requested_tokens()
        if requested is not None and requested > max_tokens_limit:
            raise ApiError(
                400,
                f"max_tokens={requested} is over this server's limit of {max_tokens_limit}.",
                param="max_tokens",
            )
        method = routes.method_for(body.model)
        return {
            "max_new_tokens": requested or min(DEFAULT_MAX_TOKENS, max_tokens_limit),
            "temperature": body.sampling_temperature(),
            "top_p": body.top_p,
            "stop": body.stop,
            "seed": body.seed,
            "raw": raw,
            "timeout": request_timeout_s,
            "method": method,
            "logprobs": body.logprob_alternatives(),
        }

    def too_long(prompt_field: str) -> ApiError:
        return ApiError(
            400,
            f"The {prompt_field} and max_tokens do not fit in the context window of {engine.context_window} "
            f"tokens; shorten the {prompt_field} or lower max_tokens.",
            code="context_length_exceeded",
            param=prompt_field,
        )

    def timed_out() -> ApiError:
        return ApiError(
            503,
            f"The request did not finish within this server's deadline of {request_timeout_s} s; "
            "lower max_tokens or retry later.",
            kind="server_error",
            code="timeout",
        )

    @contextlib.contextmanager
    def client_errors(prompt_field: str, tools: bool = False) -> Iterator[None]:
        """Errors a request caused, as the 400s and 503s that tell the client what to change."""
        try:
            yield
        except PromptTooLongError as exc:
            raise too_long(prompt_field) from exc
        except MissingDocumentSpans as exc:
            raise ApiError(400, str(exc), param=prompt_field, code="document_spans_missing") from exc
        except PromptError as exc:  # a message, tool call or document span the model cannot be given
            raise ApiError(400, str(exc), param=prompt_field) from exc
        except TemplateError as exc:  # e.g. a template that wants user and assistant turns to alternate
            raise ApiError(
                400, f"The model's chat template refused these messages: {exc}", param=prompt_field
            ) from exc
        except GenerationTimeout as exc:
            raise timed_out() from exc
        except (ValueError, TypeError) as exc:
            if not tools:
                raise
            raise ApiError(400, str(exc), param="tools") from exc  # our own message on a tool or a choice

    async def answer(
        request: Request,
        start: Callable[[threading.Event], Awaitable[T]],
        prompt_field: str,
        tools: bool = False,
    ) -> T:
        """One non-streamed answer, given up (its generation cancelled) if the client disconnects first.

        start: begins the generation, which stops once the event it is handed is set."""

        async def run(cancel: threading.Event) -> T:
            with client_errors(prompt_field, tools):
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

    def tool_arguments(body: schema.ChatCompletionRequest, options: dict[str, Any]) -> dict[str, Any]:
        """Keyword arguments of `generate_with_tools` and `astream_with_tools` for a request."""
        return {
            "tools": body.tool_list(),
            "tool_choice": body.chosen_tool(),
            "parallel_tool_calls": body.parallel_tool_calls,
            **{k: v for k, v in options.items() if k != "raw"},  # tools need the chat template
        }

    def constraints(body: schema.ChatCompletionRequest) -> dict[str, Any]:
        try:
            return body.constraints()
        except ValueError as exc:
            raise ApiError(
                400, str(exc), param="response_format" if body.response_format else "tools"
            ) from exc

    def with_documents_located(messages: list[dict[str, Any]], options: dict[str, Any]) -> LocatedPrompt:
        """The messages, with a method that reads documents told where they are, or that there are
        none: a chat without documents is answered (`rag_mspoe.connectors.document_finder`)."""
        spec = options["method"]
        return locate_documents(messages, engine.method if spec is ENGINE_DEFAULT else spec)

    def open_stream(prompt: Any, options: dict[str, Any], prompt_field: str) -> Any:
        with client_errors(prompt_field):
            return batcher.stream(prompt, options)

    def sse(events: Callable[[], AsyncIterator[dict[str, Any]]]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for event in events():
                    yield f"data: {json.dumps(event)}\n\n"
            except Exception as exc:  # the status line is sent already: report in the stream
                if isinstance(exc, GenerationTimeout):
                    error = timed_out().body
                else:
                    logger.exception("Generation failed inside a stream")
                    error = schema.error_body(UNEXPECTED, "server_error")
                yield f"data: {json.dumps(error)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": engine.name,
            "method": method_name(engine.method),
            "batching": batcher.stats(),
            **(await health_details() if health_details is not None else {}),
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [
            {"id": n, "object": "model", "created": started, "owned_by": "rag-mspoe"} for n in routes.names()
        ]
        return {"object": "list", "data": data}

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        openapi_extra={"requestBody": bodies["/v1/chat/completions"]},
    )
    async def chat_completions(request: Request) -> Any:
        body = await read_body(request, schema.ChatCompletionRequest)
        options = {**settings(body, raw=False), **constraints(body)}
        if body.calls_tools():
            return await tool_reply(request, body, options)
        located = with_documents_located(body.prompt(), options)
        if not body.stream:
            result = await answer(
                request, lambda cancel: batcher.generate(located.messages, options, cancel), "messages"
            )
            return schema.chat_completion(with_documents_read(result, located), body.model)
        stream = open_stream(located.messages, options, "messages")
        chunk_id = schema.new_id("chatcmpl")
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[dict[str, Any]]:
            yield schema.chat_chunk(chunk_id, body.model, {"role": "assistant", "content": ""})
            async for piece in stream:
                logprobs = openai_chat_logprobs(piece.tokens) if body.logprobs else None
                yield schema.chat_chunk(chunk_id, body.model, {"content": piece}, logprobs)
            assert stream.result is not None
            result = with_documents_read(stream.result, located)
            yield schema.final_chat_chunk(chunk_id, body.model, result, result.finish_reason)
            if include_usage:
                yield schema.usage_chunk(chunk_id, body.model, [stream.result], "chat.completion.chunk")

        return sse(events)

    async def tool_reply(
        request: Request, body: schema.ChatCompletionRequest, options: dict[str, Any]
    ) -> Any:
        """An answer that may call tools; streamed, its calls come as OpenAI's delta.tool_calls.
        Requests offering the same tools with the same settings batch like any others."""
        with client_errors("messages", tools=True):
            plan = plan_tools(engine, body.prompt(), **tool_arguments(body, options))
        if not body.stream:

            async def start(cancel: threading.Event) -> ToolAnswer:
                return plan.answer(await batcher.generate(plan.prompt, plan.settings, cancel))

            reply = await answer(request, start, "messages", tools=True)
            return schema.tool_call_completion(reply, body.model)
        with client_errors("messages", tools=True):
            stream = AsyncToolStream(batcher.stream(plan.prompt, plan.settings), plan)
        chunk_id = schema.new_id("chatcmpl")
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[dict[str, Any]]:
            yield schema.chat_chunk(chunk_id, body.model, {"role": "assistant", "content": ""})
            async for event in stream:
                yield schema.chat_chunk(chunk_id, body.model, schema.tool_stream_delta(event))
            assert stream.answer is not None
            yield schema.final_chat_chunk(
                chunk_id, body.model, stream.answer.result, stream.answer.finish_reason
            )
            if include_usage:
                yield schema.usage_chunk(
                    chunk_id, body.model, [stream.answer.result], "chat.completion.chunk"
                )

        return sse(events)

    @app.post(
        "/v1/completions", response_model=None, openapi_extra={"requestBody": bodies["/v1/completions"]}
    )
    async def completions(request: Request) -> Any:
        body = await read_body(request, schema.CompletionRequest)
        options = settings(body, raw=True)
        prompts = body.texts()

        async def echoed(prompt: str) -> tuple[TokenLogprob, ...] | None:
            """With echo and logprobs, the prompt's own tokens scored (one more forward of it)."""
            if not (body.echo and body.logprobs is not None):
                return None
            top = body.logprobs
            return await answer(
                request,
                lambda _: asyncio.to_thread(
                    engine.prompt_logprobs, prompt, top=top, raw=True, method=options["method"]
                ),
                "prompt",
            )

        async def choice(prompt: str) -> schema.TextChoice:
            scored = await echoed(prompt)
            result = await answer(request, lambda cancel: batcher.generate(prompt, options, cancel), "prompt")
            return schema.TextChoice(result, prompt if body.echo else "", scored)

        if not body.stream:
            # Several prompts wait together, so the batcher can run them as one batch.
            return schema.text_completion(await asyncio.gather(*map(choice, prompts)), body.model)
        scored = [await echoed(prompt) for prompt in prompts]
        streams: list[AsyncTextStream] = []
        try:
            for prompt in prompts:
                streams.append(open_stream(prompt, options, "prompt"))
        except ApiError:  # a bad prompt fails the request; the streams opened before it never run
            for stream in streams:
                stream.close()
            raise
        chunk_id = schema.new_id("cmpl")
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[dict[str, Any]]:
            for index, prompt in enumerate(prompts if body.echo else []):
                logprobs = openai_text_logprobs(scored[index])
                yield schema.text_chunk(chunk_id, body.model, prompt, logprobs, index)
            results: dict[int, GenerationResult] = {}
            async for index, item in interleaved(streams):
                if isinstance(item, GenerationResult):  # this prompt's answer has ended
                    results[index] = item
                    yield schema.final_text_chunk(chunk_id, body.model, item, index)
                    continue
                tokens = schema.after_prefix(item.tokens, prompts[index] if body.echo else "")
                logprobs = openai_text_logprobs(tokens) if body.logprobs is not None else None
                yield schema.text_chunk(chunk_id, body.model, item, logprobs, index)
            if include_usage:
                yield schema.usage_chunk(chunk_id, body.model, list(results.values()), "text_completion")

        return sse(events)

    return app
