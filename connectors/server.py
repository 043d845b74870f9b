"""An OpenAI-compatible HTTP server for the rescaled model: chat and text completions, streaming or not.

    rag-mspoe serve --method mspoe            # http://127.0.0.1:8000/v1, model "smollm2-135m-instruct"
    app = create_app(Engine.load())           # or mount the FastAPI app yourself

The request's `model` picks the rescaling method without reloading weights:
"<name>" uses the server's default method, "<name>+<method>" another one ("+none", "+pi",
"+mspoe", ..., or a config registered at start-up with --method-config NAME=PATH).
Every request goes through the one engine, whose lock queues concurrent requests, so answers
under concurrency equal answers one at a time. With max_batch_size > 1, greedy requests with
equal settings that wait together run as one batch (`rag_mspoe.connectors.batching`): more
throughput under load, at the price of bf16 answers that can drift from a request alone.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from rag_mspoe.connectors import openai_schema as schema
from rag_mspoe.connectors.batching import RequestBatcher
from rag_mspoe.engine import Engine, GenerationResult, GenerationTimeout, PromptTooLongError
from rag_mspoe.methods import NAMED_METHODS, MethodConfig, method_name, parse_method
from rag_mspoe.tool_calls import ToolAnswer, generate_with_tools

DEFAULT_MAX_TOKENS = 256


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


class ModelRoutes:
    """Model names the server answers to, each a method on the one engine."""

    def __init__(self, engine: Engine, extra_methods: dict[str, MethodConfig] | None = None) -> None:
        self.engine = engine
        self.methods: dict[str, MethodConfig | None] = {"none": None}
        self.methods.update({name: parse_method(name) for name in NAMED_METHODS})
        self.methods.update(extra_methods or {})

    def names(self) -> list[str]:
        return [self.engine.name] + [f"{self.engine.name}+{name}" for name in self.methods]

    def method_for(self, model: str) -> MethodConfig | None | str:
        """The method a model name asks for; the string "default" for the server's default."""
        base, _, suffix = model.partition("+")
        if base != self.engine.name or (suffix and suffix not in self.methods):
            raise ApiError(
                404,
                f"The model {model!r} does not exist; available: {', '.join(self.names())}.",
                code="model_not_found",
                param="model",
            )
        return self.methods[suffix] if suffix else "default"


def create_app(
    engine: Engine,
    *,
    api_key: str | None = None,
    extra_methods: dict[str, MethodConfig] | None = None,
    max_tokens_limit: int = 1024,
    max_request_bytes: int = 1 << 20,
    max_batch_size: int = 1,
    batch_wait_ms: float = 10.0,
) -> Any:
    """The FastAPI application serving `engine`.

    max_batch_size: greedy non-streaming requests run together in batches of up to this many
    (1: one at a time); batch_wait_ms: how long the first waits for others to join it."""
    routes = ModelRoutes(engine, extra_methods)
    batcher = RequestBatcher(engine, max_batch_size, batch_wait_ms / 1000)
    app = FastAPI(title="rag-mspoe", version="1")
    started = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status)

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(schema.error_body(f"Internal error: {exc}", "server_error"), status_code=500)

    async def read_body(request: Request, model_cls: type[schema._CompletionParams]) -> Any:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise ApiError(
                401, "Missing or wrong API key; send 'Authorization: Bearer <key>'.", code="invalid_api_key"
            )
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_request_bytes:
            raise ApiError(
                413, f"The request body is over {max_request_bytes} bytes.", code="request_too_large"
            )
        raw = await request.body()
        if len(raw) > max_request_bytes:
            raise ApiError(
                413, f"The request body is over {max_request_bytes} bytes.", code="request_too_large"
            )
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"The request body is not valid JSON: {exc}.") from exc
        try:
            return model_cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ApiError(400, f"Invalid request: {where}: {first['msg']}.", param=where or None) from exc

    def settings(body: schema._CompletionParams, raw: bool) -> dict[str, Any]:
        requested = body.requested_tokens()
        if requested is not None and requested > max_tokens_limit:
            raise ApiError(
                400,
                f"max_tokens={requested} is over this server's limit of {max_tokens_limit}.",
                param="max_tokens",
            )
        method = routes.method_for(body.model)
        out: dict[str, Any] = {
            "max_new_tokens": requested or min(DEFAULT_MAX_TOKENS, max_tokens_limit),
            "temperature": body.temperature,
            "top_p": body.top_p,
            "stop": body.stop,
            "seed": body.seed,
            "raw": raw,
        }
        if method != "default":
            out["method"] = method if method is not None else "none"
        return out

    async def run(prompt: Any, options: dict[str, Any]) -> GenerationResult:
        try:
            return await batcher.generate(prompt, options)
        except PromptTooLongError as exc:
            raise ApiError(400, str(exc), code="context_length_exceeded", param="messages") from exc
        except GenerationTimeout as exc:
            raise ApiError(503, str(exc), kind="server_error", code="timeout") from exc
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc)) from exc

    async def call_tools(body: schema.ChatCompletionRequest, options: dict[str, Any]) -> ToolAnswer:
        options = {k: v for k, v in options.items() if k != "raw"}  # tools need the chat template
        try:
            return await asyncio.to_thread(
                generate_with_tools,
                engine,
                body.prompt(),
                body.tool_list(),
                tool_choice=body.chosen_tool(),
                parallel_tool_calls=body.parallel_tool_calls,
                **options,
            )
        except PromptTooLongError as exc:
            raise ApiError(400, str(exc), code="context_length_exceeded", param="messages") from exc
        except GenerationTimeout as exc:
            raise ApiError(503, str(exc), kind="server_error", code="timeout") from exc
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc), param="tools") from exc

    def constraints(body: schema.ChatCompletionRequest) -> dict[str, Any]:
        try:
            return body.constraints()
        except ValueError as exc:
            raise ApiError(
                400, str(exc), param="response_format" if body.response_format else "tools"
            ) from exc

    def open_stream(prompt: Any, options: dict[str, Any]) -> Any:
        try:
            return engine.astream(prompt, **options)
        except PromptTooLongError as exc:
            raise ApiError(400, str(exc), code="context_length_exceeded", param="messages") from exc
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc)) from exc

    def sse(events: Callable[[], AsyncIterator[dict[str, Any]]]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for event in events():
                    yield f"data: {json.dumps(event)}\n\n"
            except Exception as exc:  # the status line is sent already: report in the stream
                yield f"data: {json.dumps(schema.error_body(str(exc), 'server_error'))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": engine.name,
            "method": method_name(engine.method),
            "batching": batcher.stats(),
        }

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise ApiError(
                401, "Missing or wrong API key; send 'Authorization: Bearer <key>'.", code="invalid_api_key"
            )
        data = [
            {"id": n, "object": "model", "created": started, "owned_by": "rag-mspoe"} for n in routes.names()
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Any:
        body = await read_body(request, schema.ChatCompletionRequest)
        options = {**settings(body, raw=False), **constraints(body)}
        if body.calls_tools():
            return await tool_reply(body, options)
        if not body.stream:
            return schema.chat_completion(await run(body.prompt(), options), body.model)
        stream = open_stream(body.prompt(), options)
        chunk_id = schema.new_id("chatcmpl")
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[dict[str, Any]]:
            yield schema.chat_chunk(chunk_id, body.model, {"role": "assistant", "content": ""})
            async for piece in stream:
                yield schema.chat_chunk(chunk_id, body.model, {"content": piece})
            assert stream.result is not None
            yield schema.chat_chunk(chunk_id, body.model, {}, stream.result.finish_reason)
            if include_usage:
                yield schema.usage_chunk(chunk_id, body.model, stream.result, "chat.completion.chunk")

        return sse(events)

    async def tool_reply(body: schema.ChatCompletionRequest, options: dict[str, Any]) -> Any:
        """An answer that may call tools; streamed whole, as a partial call would not parse."""
        answer = await call_tools(body, options)
        if not body.stream:
            return schema.tool_call_completion(answer, body.model)
        chunk_id = schema.new_id("chatcmpl")
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[dict[str, Any]]:
            yield schema.chat_chunk(chunk_id, body.model, {"role": "assistant", "content": ""})
            for delta in schema.tool_call_deltas(answer):
                yield schema.chat_chunk(chunk_id, body.model, delta)
            yield schema.chat_chunk(chunk_id, body.model, {}, answer.finish_reason)
            if include_usage:
                yield schema.usage_chunk(chunk_id, body.model, answer.result, "chat.completion.chunk")

        return sse(events)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Any:
        body = await read_body(request, schema.CompletionRequest)
        options = settings(body, raw=True)
        prefix = body.text() if body.echo else ""
        if not body.stream:
            return schema.text_completion(await run(body.text(), options), body.model, prefix)
        stream = open_stream(body.text(), options)
        chunk_id = schema.new_id("cmpl")
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[dict[str, Any]]:
            if prefix:
                yield schema.text_chunk(chunk_id, body.model, prefix)
            async for piece in stream:
                yield schema.text_chunk(chunk_id, body.model, piece)
            assert stream.result is not None
            yield schema.text_chunk(chunk_id, body.model, "", stream.result.finish_reason)
            if include_usage:
                yield schema.usage_chunk(chunk_id, body.model, stream.result, "text_completion")

        return sse(events)

    return app
