"""A limit on the connections one client address may hold open at once.

`--max-connections` (uvicorn's concurrency limit) counts every connection, so one client that
opens many can take them all and lock everyone else out. With a limit per address, such a
client's connections past it get a 429 and are closed at once, and other addresses are served as
before. Behind a reverse proxy every connection comes from the proxy's address: leave this limit
off there and let the proxy limit its clients.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from rag_mspoe.connectors.header_deadline import HeaderDeadlineProtocol, closing_response

_REFUSED = closing_response(
    b"429 Too Many Requests",
    b"Too many open connections from your address; close some, or reuse one with keep-alive.",
    headers=b"retry-after: 1\r\n",
)


class ClientLimitProtocol(HeaderDeadlineProtocol):
    """The server's protocol, refusing a client address's connections past `max_per_client`."""

    max_per_client: int | None = None
    open_by_client: Counter[str]  # one per server (`protocol_with`): connections open per address

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._counted_as: str | None = None
        address = _client_address(transport)
        if self.max_per_client is None or address is None:
            return
        if self.open_by_client[address] >= self.max_per_client:
            transport.write(_REFUSED)
            transport.close()
            return
        self.open_by_client[address] += 1
        self._counted_as = address

    def connection_lost(self, exc: Exception | None) -> None:
        if self._counted_as is not None:
            self.open_by_client[self._counted_as] -= 1
            if not self.open_by_client[self._counted_as]:
                del self.open_by_client[self._counted_as]
            self._counted_as = None
        super().connection_lost(exc)


def _client_address(transport: asyncio.Transport) -> str | None:
    """The peer's IP address; None for a peer without one (a Unix socket)."""
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else None


def protocol_with(
    header_timeout_s: float, max_connections_per_client: int | None = None
) -> type[ClientLimitProtocol]:
    """The protocol class to give uvicorn (`http=`): this header deadline, and at most
    `max_connections_per_client` open connections per client address (None: no such limit)."""
    if not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s must be positive, got {header_timeout_s}.")
    if max_connections_per_client is not None and (
        isinstance(max_connections_per_client, bool)
        or not isinstance(max_connections_per_client, int)
        or max_connections_per_client < 1
    ):
        raise ValueError(
            "max_connections_per_client must be a whole number >= 1 or None, "
            f"got {max_connections_per_client!r}."
        )
    attributes: dict[str, Any] = {
        "header_timeout_s": header_timeout_s,
        "max_per_client": max_connections_per_client,
        "open_by_client": Counter(),
    }
    return type("ServerProtocol", (ClientLimitProtocol,), attributes)
