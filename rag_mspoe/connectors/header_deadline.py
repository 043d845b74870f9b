"""A deadline on request headers: a connection whose next request's headers take too long is closed.

uvicorn times out a keep-alive connection only while it is idle after an answer, and the first
byte of a request stops that clock. So a client could open connections and trickle header bytes
(or send none at all) and hold each one for ever ("slowloris"). Here every request's headers
must be whole within `header_timeout_s` of the connection opening or of the request's first
byte; past it the client gets a 408 and the connection closes. The body has its own deadline
(`request_guard`), and generation its own (the server's `request_timeout_s`).
"""

from __future__ import annotations

import asyncio

from rag_mspoe.connectors.half_close import HalfCloseProtocol


def closing_response(status: bytes, message: bytes, headers: bytes = b"") -> bytes:
    """A whole plain-text HTTP/1.1 answer that closes the connection, as raw bytes: for the
    protocol to write where no request reached the app."""
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
        + headers
        + b"content-length: %d\r\n\r\n" % len(message)
        + message
    )


_TIMED_OUT = closing_response(b"408 Request Timeout", b"The request headers took too long to arrive.")


class HeaderDeadlineProtocol(HalfCloseProtocol):
    """The server's HTTP/1.1 protocol, with a deadline on each request's headers."""

    header_timeout_s: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._start_header_clock()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._start_header_clock()  # the first bytes of a next request on a kept-alive connection
        super().data_received(data)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request's headers arrived whole
            self._stop_header_clock()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_clock()
        super().connection_lost(exc)

    def _start_header_clock(self) -> None:
        self._stop_header_clock()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _stop_header_clock(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        self.transport.write(_TIMED_OUT)
        self.transport.close()
