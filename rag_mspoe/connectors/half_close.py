"""The server's HTTP/1.1 protocol: uvicorn's h11 one, which also answers a client that half-closed.

A client may shut down its sending side once its request is out (`shutdown(SHUT_WR)`, `curl
--no-buffer` behind some proxies, `nc -N`) and still read the answer. uvicorn closes the
connection on that end-of-file, so such a client got nothing. Here the connection stays open
for the answer when a whole request is waiting for one.

A client that closed completely sends the same end-of-file, and its generation must still stop.
To tell them apart the server sends an interim `100 Continue` (every HTTP/1.1 client skips 1xx
answers it did not ask for): a socket that is gone answers it with a reset, which the server
notices within `PROBE_INTERVAL_S` and treats as the disconnect it is. HTTP/1.0 has no interim
answers, so an HTTP/1.0 client that half-closed cannot be told from one that left: its answer is
generated and sent all the same.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

PROBE_INTERVAL_S = 0.05
_REQUEST_SENT = (h11.DONE, h11.MUST_CLOSE)  # the client's states once its request is whole
_TCP_CLOSE = 7  # Linux tcp_states.h: the state a connection enters when a reset arrives


class HalfCloseProtocol(H11Protocol):
    """uvicorn's h11 protocol, keeping a half-closed connection open until its answer is sent."""

    def eof_received(self) -> bool | None:  # type: ignore[override]  # asyncio.Protocol allows True
        cycle = self.cycle
        # A request that said it is the last one (`Connection: close`, HTTP/1.0) leaves the client
        # in MUST_CLOSE rather than DONE once it is whole: it waits for its answer all the same.
        if cycle is None or cycle.response_complete or self.conn.their_state not in _REQUEST_SENT:
            return None  # no whole request waits for an answer: close, as uvicorn does
        cycle.keep_alive = False  # nothing more can arrive: close once the answer is out
        if self.scope.get("http_version") == "1.1" and not cycle.response_started:
            self.transport.write(self.conn.send(h11.InformationalResponse(status_code=100, headers=[])))
        self.loop.call_later(PROBE_INTERVAL_S, self._watch_peer)
        return True  # keep the sending side open

    def _watch_peer(self) -> None:
        """Abort the connection (a disconnect for the app) once the peer is gone; else look again."""
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None or cycle.response_complete:
            return
        if _reset(self.transport.get_extra_info("socket")):
            self.transport.abort()
            return
        self.loop.call_later(PROBE_INTERVAL_S, self._watch_peer)


def _reset(sock: Any) -> bool:
    """Whether the peer reset the connection (it had closed it completely)."""
    if sock is None:
        return True
    try:
        if hasattr(socket, "TCP_INFO"):
            state = struct.unpack("B", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1))[0]
            if state == _TCP_CLOSE:
                return True
        return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0
    except OSError:
        return True
