"""POST /v1/completions: raw text continued, one choice per prompt, streamed or not; with echo
and logprobs, the prompt's own tokens scored too (as lm-evaluation-harness asks)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request

from rag_mspoe.connectors import openai_schema as schema
from rag_mspoe.connectors.server_errors import ApiError
from rag_mspoe.connectors.server_requests import RequestRunner, read_body
from rag_mspoe.connectors.server_streams import includes_usage, interleaved, sse
from rag_mspoe.engine import GenerationResult
from rag_mspoe.engine.text_stream import AsyncTextStream
from rag_mspoe.engine.token_logprobs import TokenLogprob, openai_text_logprobs


def add_completions_route(app: FastAPI, runner: RequestRunner, request_body: dict[str, Any]) -> None:
    # The endpoint keeps its name and carries no docstring: FastAPI makes the OpenAPI operation id
    # and description from them.
    @app.post("/v1/completions", response_model=None, openapi_extra={"requestBody": request_body})
    async def completions(request: Request) -> Any:
        body = await read_body(request, schema.CompletionRequest)
        completion = TextCompletion(runner, request, body)
        return await completion.streamed() if body.stream else await completion.whole()


class TextCompletion:
    """One request to /v1/completions: its prompts, their settings, and the request to answer."""

    def __init__(self, runner: RequestRunner, request: Request, body: schema.CompletionRequest) -> None:
        self.runner, self.request, self.body = runner, request, body
        self.options = runner.settings(body, raw=True)
        self.prompts = body.texts()

    async def echoed(self, prompt: str) -> tuple[TokenLogprob, ...] | None:
        """With echo and logprobs, the prompt's own tokens scored (one more forward of it)."""
        if not (self.body.echo and self.body.logprobs is not None):
            return None
        top, method, engine = self.body.logprobs, self.options["method"], self.runner.engine
        return await self.runner.answer(
            self.request,
            lambda _: asyncio.to_thread(engine.prompt_logprobs, prompt, top=top, raw=True, method=method),
            "prompt",
        )

    async def choice(self, prompt: str) -> schema.TextChoice:
        scored = await self.echoed(prompt)
        result = await self.runner.answer(
            self.request, lambda cancel: self.runner.batcher.generate(prompt, self.options, cancel), "prompt"
        )
        return schema.TextChoice(result, prompt if self.body.echo else "", scored)

    async def whole(self) -> dict[str, Any]:
        # Several prompts wait together, so the batcher can run them as one batch.
        choices = await asyncio.gather(*map(self.choice, self.prompts))
        return schema.text_completion(choices, self.body.model)

    def open_streams(self) -> list[AsyncTextStream]:
        streams: list[AsyncTextStream] = []
        try:
            for prompt in self.prompts:
                streams.append(self.runner.open_stream(prompt, self.options, "prompt"))
        except ApiError:  # a bad prompt fails the request; the streams opened before it never run
            for stream in streams:
                stream.close()
            raise
        return streams

    async def streamed(self) -> Any:
        body, prompts = self.body, self.prompts
        scored = [await self.echoed(prompt) for prompt in prompts]
        streams = self.open_streams()
        chunk_id = schema.new_id("cmpl")

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
            if includes_usage(body):
                yield schema.usage_chunk(chunk_id, body.model, list(results.values()), "text_completion")

        return sse(events, self.runner.request_timeout_s)
