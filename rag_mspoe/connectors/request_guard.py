"""What every HTTP request passes before the API sees it: who may call, and how big and slow its body may be.

An ASGI middleware in front of the FastAPI app:

- Host: only the names the server answers to (loopback names by default), so a web page that
  rebinds its DNS name to 127.0.0.1 is refused.
- Origin: browsers send it on every cross-origin POST (text/plain ones included, which skip
  the CORS preflight); only the server's own origin and the `cors_origins` given may call.
- API key: a bearer token compared in constant time; the scheme is case-insensitive.
- Body: counted as it arrives, Content-Length or chunked, and refused with 413 as soon as it
  passes the limit, or with 408 when it takes longer than the body deadline; at most the limit
  is ever held in memory.
- Errors nobody planned for: a generic 500 (the details go to the log), never exception text.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from starlette.datastructures import Headers

from rag_mspoe.connectors.openai_schema import error_body

logger = logging.getLogger("rag_mspoe.connectors.server")

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
ANY = "*"
UNEXPECTED = "The server failed on this request; the details are in its log."


class Refused(Exception):
    """A request answered with an error before the app sees it."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass(frozen=True)
class GuardSettings:
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS  # "*": any host
    cors_origins: tuple[str, ...] = ()  # "*": any origin
    max_request_bytes: int = 1 << 20
    body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be at least 1, got {self.max_request_bytes}.")
        if not self.body_timeout_s > 0:
            raise ValueError(
                f"body_timeout_s must be a positive number of seconds, got {self.body_timeout_s}."
            )
        object.__setattr__(self, "allowed_hosts", tuple(_host_name(h) for h in self.allowed_hosts))
        object.__setattr__(self, "cors_origins", tuple(_origin(o) for o in self.cors_origins))


def _host_name(host: str) -> str:
    """The name part of a Host header value or an --allowed-host entry, lowercased, port dropped."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[1 : host.find("]")] if "]" in host else host
    name, sep, port = host.rpartition(":")
    return name if sep and port.isdigit() and ":" not in name else host


def _origin(origin: str) -> str:
    return origin.strip().lower().rstrip("/")


class RequestGuard:
    """ASGI middleware applying `GuardSettings` to every HTTP request."""

    def __init__(self, app: Any, settings: GuardSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        started = body_read = False
        deadline = asyncio.get_running_loop().time() + self.settings.body_timeout_s
        try:
            cross_origin = self._check_origin(headers)
            if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                await _respond(send, 204, None, self._cors_headers(cross_origin, preflight=True))
                return
            if scope["path"].startswith("/v1"):
                self._check_key(headers)
            body = await self._read_body(headers, receive, deadline)
            body_read = True
            if body is None:  # the client went away while sending
                return
            replayed = False

            async def replay() -> dict[str, Any]:
                nonlocal replayed
                if replayed:
                    return dict(await receive())  # what follows the body: a disconnect
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}

            async def send_with_cors(message: dict[str, Any]) -> None:
                nonlocal started
                if message["type"] == "http.response.start":
                    started = True
                    extra = [(k.encode(), v.encode()) for k, v in self._cors_headers(cross_origin)]
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
                await send(message)

            await self.app(scope, replay, send_with_cors)
        except Refused as refusal:
            if started:
                raise
            error = error_body(refusal.message, code=refusal.code)
            if body_read:
                await _respond(send, refusal.status, error, [])
                return
            # A body left unread would be taken for the next request: close the connection, but
            # first read and drop what the client is still sending, within the body deadline (a
            # socket closed on unread data sends a reset, which can destroy the answer before a
            # client that writes its whole body first gets to read it).
            await _respond(send, refusal.status, error, [("connection", "close")], more_body=True)
            if refusal.status != 408:  # a client too slow to send is not waited for
                await _discard(receive, deadline)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception:
            logger.exception("Unexpected error on %s %s", scope["method"], scope["path"])
            if not started:
                await _respond(send, 500, error_body(UNEXPECTED, "server_error"), [])

    def _check_origin(self, headers: Headers) -> str | None:
        """The request's Origin when it is an allowed cross-origin one; refuses a foreign Host or Origin."""
        host = headers.get("host")
        allowed = self.settings.allowed_hosts
        if host is None or (ANY not in allowed and _host_name(host) not in allowed):
            raise Refused(
                403,
                f"Host {host!r} is not one this server answers to ({', '.join(allowed)}); "
                "start it with --allowed-host NAME to add one.",
                "host_not_allowed",
            )
        origin = headers.get("origin")
        if origin is None or urlsplit(origin).netloc.lower() == host.lower():
            return None  # not from a browser, or from a page this server served
        if ANY in self.settings.cors_origins or _origin(origin) in self.settings.cors_origins:
            return origin
        raise Refused(
            403,
            f"Cross-origin requests from {origin!r} are not allowed; start the server with "
            "--cors-origin ORIGIN to allow a web page to call it.",
            "origin_not_allowed",
        )

    def _cors_headers(self, origin: str | None, preflight: bool = False) -> Iterable[tuple[str, str]]:
        if origin is None:
            return []
        out = [("access-control-allow-origin", origin), ("vary", "Origin")]
        if preflight:
            out += [
                ("access-control-allow-methods", "GET, POST, OPTIONS"),
                ("access-control-allow-headers", "authorization, content-type"),
                ("access-control-max-age", "600"),
            ]
        return out

    def _check_key(self, headers: Headers) -> None:
        if self.settings.api_key is None:
            return
        scheme, _, token = headers.get("authorization", "").strip().partition(" ")
        expected = self.settings.api_key.encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise Refused(
                401, "Missing or wrong API key; send 'Authorization: Bearer <key>'.", "invalid_api_key"
            )

    async def _read_body(self, headers: Headers, receive: Any, deadline: float) -> bytes | None:
        """The whole body, read within the deadline and the size limit; None if the client left."""
        limit = self.settings.max_request_bytes
        too_large = Refused(413, f"The request body is over {limit} bytes.", "request_too_large")
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        try:
            async with asyncio.timeout_at(deadline):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            raise Refused(
                408,
                f"The request body did not arrive within {self.settings.body_timeout_s} s.",
                "request_timeout",
            ) from None


async def _discard(receive: Any, deadline: float) -> None:
    """Read and drop the rest of a refused body until it ends or the deadline passes; holds none of it."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout_at(deadline):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    return


async def _respond(
    send: Any,
    status: int,
    body: dict[str, Any] | None,
    headers: Iterable[tuple[str, str]],
    more_body: bool = False,
) -> None:
    payload = b"" if body is None else json.dumps(body).encode()
    raw_headers = [(k.encode(), v.encode()) for k, v in headers]
    if body is not None:
        raw_headers += [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload, "more_body": more_body})
