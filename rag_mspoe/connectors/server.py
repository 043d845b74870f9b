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

`create_app` puts the app together from one module per part: `server_models` (the model names,
GET /v1/models and /health), `server_chat` and `server_completions` (their POST routes),
`server_requests` (what those two share: settings, limits, answers cancelled with the client),
`server_streams` (server-sent events) and `server_errors` (errors in OpenAI's shape).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI

from rag_mspoe.connectors import openai_schema as schema
from rag_mspoe.connectors.batching import RequestBatcher
from rag_mspoe.connectors.request_guard import LOOPBACK_HOSTS, GuardSettings, RequestGuard
from rag_mspoe.connectors.server_chat import add_chat_route
from rag_mspoe.connectors.server_completions import add_completions_route
from rag_mspoe.connectors.server_errors import add_error_handlers
from rag_mspoe.connectors.server_models import ModelRoutes, add_model_routes
from rag_mspoe.connectors.server_requests import RequestRunner
from rag_mspoe.engine import Engine
from rag_mspoe.methods import MethodConfig

# ModelRoutes is imported from here too (tests, the type check's canary).
__all__ = ["ModelRoutes", "create_app"]


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
    runner = RequestRunner(engine, batcher, routes, max_tokens_limit, request_timeout_s)
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
    bodies, body_schemas = schema.openapi_bodies()
    describe_bodies(app, body_schemas)
    add_error_handlers(app)
    add_model_routes(app, routes, batcher, health_details)
    add_chat_route(app, runner, bodies["/v1/chat/completions"])
    add_completions_route(app, runner, bodies["/v1/completions"])
    return app


def describe_bodies(app: FastAPI, body_schemas: dict[str, Any]) -> None:
    """Add the schemas of the bodies the routes read themselves to FastAPI's OpenAPI document,
    which does not know them (`openai_schema.openapi_bodies`)."""
    described = app.openapi

    def openapi() -> dict[str, Any]:
        """FastAPI's document (made once), with those schemas."""
        fresh = app.openapi_schema is None
        document = described()
        if fresh:
            document.setdefault("components", {}).setdefault("schemas", {}).update(body_schemas)
        return document

    app.openapi = openapi  # type: ignore[method-assign]
