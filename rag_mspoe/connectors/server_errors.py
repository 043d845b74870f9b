"""The server's errors in OpenAI's shape: what a client did wrong, and what it should change.

`ApiError` is raised anywhere in a route and answered as {"error": {...}} with its status;
`client_errors` turns the engine's own errors (prompt too long, deadline passed, a template or
tool it cannot use) into such 400s and 503s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rag_mspoe.connectors import openai_schema as schema
from rag_mspoe.engine import Engine, GenerationTimeout, PromptTooLongError
from rag_mspoe.prompts.chat_template import PromptError
from rag_mspoe.prompts.document_prompts import MissingDocumentSpans


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


def add_error_handlers(app: FastAPI) -> None:
    """Answer `ApiError`s, unknown routes and wrong methods in the OpenAI error shape."""

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


def too_long(prompt_field: str, context_window: int) -> ApiError:
    return ApiError(
        400,
        f"The {prompt_field} and max_tokens do not fit in the context window of {context_window} "
        f"tokens; shorten the {prompt_field} or lower max_tokens.",
        code="context_length_exceeded",
        param=prompt_field,
    )


def timed_out(request_timeout_s: float | None) -> ApiError:
    return ApiError(
        503,
        f"The request did not finish within this server's deadline of {request_timeout_s} s; "
        "lower max_tokens or retry later.",
        kind="server_error",
        code="timeout",
    )


@contextlib.contextmanager
def client_errors(
    prompt_field: str, engine: Engine, request_timeout_s: float | None, tools: bool = False
) -> Iterator[None]:
    """Errors a request caused, as the 400s and 503s that tell the client what to change."""
    try:
        yield
    except PromptTooLongError as exc:
        raise too_long(prompt_field, engine.context_window) from exc
    except MissingDocumentSpans as exc:
        raise ApiError(400, str(exc), param=prompt_field, code="document_spans_missing") from exc
    except PromptError as exc:  # a message, tool call or document span the model cannot be given
        raise ApiError(400, str(exc), param=prompt_field) from exc
    except TemplateError as exc:  # e.g. a template that wants user and assistant turns to alternate
        raise ApiError(
            400, f"The model's chat template refused these messages: {exc}", param=prompt_field
        ) from exc
    except GenerationTimeout as exc:
        raise timed_out(request_timeout_s) from exc
    except (ValueError, TypeError) as exc:
        if not tools:
            raise
        raise ApiError(400, str(exc), param="tools") from exc  # our own message on a tool or a choice
