"""POST /v1/chat/completions: answers to chats, streamed or not, with documents located for the
methods that read them, and with tools when the request offers some."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request

from rag_mspoe.connectors import openai_schema as schema
from rag_mspoe.connectors.document_finder import with_documents_read
from rag_mspoe.connectors.server_errors import ApiError
from rag_mspoe.connectors.server_requests import RequestRunner, read_body
from rag_mspoe.connectors.server_streams import includes_usage, sse
from rag_mspoe.engine.token_logprobs import openai_chat_logprobs
from rag_mspoe.tools.tool_calls import AsyncToolStream, ToolAnswer, plan_tools


def add_chat_route(app: FastAPI, runner: RequestRunner, request_body: dict[str, Any]) -> None:
    # The endpoint keeps its name and carries no docstring: FastAPI makes the OpenAPI operation id
    # and description from them.
    @app.post("/v1/chat/completions", response_model=None, openapi_extra={"requestBody": request_body})
    async def chat_completions(request: Request) -> Any:
        return await chat_reply(runner, request)


async def chat_reply(runner: RequestRunner, request: Request) -> Any:
    body = await read_body(request, schema.ChatCompletionRequest)
    options = {**runner.settings(body, raw=False), **constraints(body)}
    if body.calls_tools():
        return await tool_reply(runner, request, body, options)
    located = runner.with_documents_located(body.prompt(), options)
    if not body.stream:
        result = await runner.answer(
            request, lambda cancel: runner.batcher.generate(located.messages, options, cancel), "messages"
        )
        return schema.chat_completion(with_documents_read(result, located), body.model)
    stream = runner.open_stream(located.messages, options, "messages")
    chunk_id = schema.new_id("chatcmpl")

    async def events() -> AsyncIterator[dict[str, Any]]:
        yield schema.chat_chunk(chunk_id, body.model, {"role": "assistant", "content": ""})
        async for piece in stream:
            logprobs = openai_chat_logprobs(piece.tokens) if body.logprobs else None
            yield schema.chat_chunk(chunk_id, body.model, {"content": piece}, logprobs)
        assert stream.result is not None
        result = with_documents_read(stream.result, located)
        yield schema.final_chat_chunk(chunk_id, body.model, result, result.finish_reason)
        if includes_usage(body):
            yield schema.usage_chunk(chunk_id, body.model, [stream.result], "chat.completion.chunk")

    return sse(events, runner.request_timeout_s)


async def tool_reply(
    runner: RequestRunner, request: Request, body: schema.ChatCompletionRequest, options: dict[str, Any]
) -> Any:
    """An answer that may call tools; streamed, its calls come as OpenAI's delta.tool_calls.
    Requests offering the same tools with the same settings batch like any others."""
    with runner.client_errors("messages", tools=True):
        plan = plan_tools(runner.engine, body.prompt(), **tool_arguments(body, options))
    if not body.stream:

        async def start(cancel: threading.Event) -> ToolAnswer:
            return plan.answer(await runner.batcher.generate(plan.prompt, plan.settings, cancel))

        reply = await runner.answer(request, start, "messages", tools=True)
        return schema.tool_call_completion(reply, body.model)
    with runner.client_errors("messages", tools=True):
        stream = AsyncToolStream(runner.batcher.stream(plan.prompt, plan.settings), plan)
    chunk_id = schema.new_id("chatcmpl")

    async def events() -> AsyncIterator[dict[str, Any]]:
        yield schema.chat_chunk(chunk_id, body.model, {"role": "assistant", "content": ""})
        async for event in stream:
            yield schema.chat_chunk(chunk_id, body.model, schema.tool_stream_delta(event))
        assert stream.answer is not None
        yield schema.final_chat_chunk(chunk_id, body.model, stream.answer.result, stream.answer.finish_reason)
        if includes_usage(body):
            yield schema.usage_chunk(chunk_id, body.model, [stream.answer.result], "chat.completion.chunk")

    return sse(events, runner.request_timeout_s)


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
        raise ApiError(400, str(exc), param="response_format" if body.response_format else "tools") from exc
