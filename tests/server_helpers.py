"""Start an ASGI app for real on a free loopback port, for the server tests."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def running(
    app: Any,
    header_timeout_s: float = 30.0,
    max_connections: int | None = None,
    max_connections_per_client: int | None = None,
) -> Iterator[str]:
    """The app served by uvicorn in a thread (with the protocol `rag-mspoe serve` uses); yields its URL."""
    import uvicorn

    port = free_port()
    from rag_mspoe.connectors.client_limit import protocol_with

    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        http=protocol_with(header_timeout_s, max_connections_per_client),
        limit_concurrency=max_connections,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def connect(url: str, from_address: str | None = None) -> socket.socket:
    """A raw TCP connection to the server at `url`, for what HTTP clients will not send; from
    another local address (any of 127.0.0.0/8 on Linux) to be another client."""
    host, port = url.removeprefix("http://").split(":")
    source = None if from_address is None else (from_address, 0)
    return socket.create_connection((host, int(port)), timeout=10, source_address=source)


def request_bytes(path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    """A POST request with a JSON body and a Content-Length, as raw bytes."""
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lowercased names) and body of one response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        received = sock.recv(65536)
        if not received:
            raise ConnectionError(f"connection closed after {data!r}")
        data += received
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        received = sock.recv(65536)
        if not received:
            raise ConnectionError("connection closed inside the body")
        body += received
    return int(status_line.split()[1]), headers, body[:length]


def sse_events(text: str) -> list[dict[str, Any]]:
    """The JSON events of a server-sent event stream's body (the closing `[DONE]` left out)."""
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@contextlib.contextmanager
def serve_process(log: Path, *options: str, start_timeout_s: float = 120) -> Iterator[str]:
    """`rag-mspoe serve OPTIONS` as a real process on a free loopback port, its log in `log`;
    yields its URL, and stops it on exit."""
    import os
    import subprocess
    import sys

    import httpx

    port = free_port()
    command = [
        sys.executable,
        "-m",
        "rag_mspoe.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *options,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as written:
        process = subprocess.Popen(command, stdout=written, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                try:
                    httpx.get(f"{url}/health", timeout=2).raise_for_status()
                    break
                except httpx.HTTPError:
                    assert process.poll() is None, log.read_text()[-3000:]
                    assert time.monotonic() < deadline, "the server did not start"
                    time.sleep(0.3)
            yield url
        finally:
            process.terminate()
            process.wait(timeout=30)
