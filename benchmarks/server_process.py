"""A `rag-mspoe serve` process on a free loopback port, for the server benchmarks."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx


@dataclass
class RunningServer:
    process: subprocess.Popen
    base_url: str
    model: str  # the model name /health reports


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serve(*options: str, start_timeout_s: float = 300) -> Iterator[RunningServer]:
    """Start `rag-mspoe serve OPTIONS`, wait until /health answers, stop it on exit."""
    port = free_port()
    command = [sys.executable, "-m", "rag_mspoe.cli", "serve", "--port", str(port), *options]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                model = httpx.get(f"{base_url}/health", timeout=2).json()["model"]
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise SystemExit("the server did not start") from None
                time.sleep(0.5)
        yield RunningServer(process, base_url, model)
    finally:
        process.terminate()
        process.wait(timeout=30)
