"""A small OpenAI-compatible server on a loopback port, for what no real peer server is at hand for:
one without prompt log-probabilities (as llama.cpp's), one that fails before it answers."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class FakeBehaviour:
    """prompt_logprobs: echo scores prompt tokens (-1.0 each) or gives 0.0 for them, as llama.cpp's
    server does; failures: how many requests get a 503 before the server answers; answer: the text
    every generation gives."""

    prompt_logprobs: bool = True
    shifted: bool = False  # scores one token off, as llama-cpp-python's: the greedy token not the likeliest
    failures: int = 0
    answer: str = "Paris"
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    keys: set[str | None] = field(default_factory=set)  # the Authorization headers that came


def completion(body: dict[str, Any], behaviour: FakeBehaviour, tokenizer: Any) -> dict[str, Any]:
    """The answer, and with echo and logprobs the prompt's tokens (by `tokenizer`) and the answer's
    one, each scored -1.0 (0.0 for the prompt's without prompt log-probabilities)."""
    text = (body["prompt"] if body.get("echo") else "") + behaviour.answer
    logprobs = None
    if body.get("logprobs") is not None:
        encoded = tokenizer(body["prompt"], add_special_tokens=False, return_offsets_mapping=True)
        offsets = [start for start, _ in encoded["offset_mapping"]]
        value = -1.0 if behaviour.prompt_logprobs else 0.0
        tokens = [tokenizer.decode([i]) for i in encoded["input_ids"]] + [behaviour.answer]
        other = -0.5 if behaviour.shifted else -2.0  # another token's, at the answer's step
        logprobs = {
            "tokens": tokens,
            "text_offset": [*offsets, len(body["prompt"])],
            "token_logprobs": [None] + [value] * (len(offsets) - 1) + [-1.0],
            "top_logprobs": [None, *({t: value} for t in tokens[1:-1]), {"x": other, behaviour.answer: -1.0}]
            if body["logprobs"]
            else None,
        }
    usage = {"completion_tokens": 1}
    return {"choices": [{"index": 0, "text": text, "logprobs": logprobs}], "usage": usage}


@contextlib.contextmanager
def fake_endpoint(behaviour: FakeBehaviour, tokenizer: Any) -> Iterator[str]:
    """The server in a thread, tokenizing with `tokenizer`; yields its base URL (.../v1)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802  (the name http.server calls)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            behaviour.requests.append((self.path, body))
            behaviour.keys.add(self.headers.get("Authorization"))
            if behaviour.failures > 0:
                behaviour.failures -= 1
                self._reply(503, {"error": {"message": "overloaded", "type": "server_error"}})
            elif self.path == "/v1/completions":
                self._reply(200, completion(body, behaviour, tokenizer))
            elif self.path == "/v1/chat/completions":
                message = {"role": "assistant", "content": behaviour.answer}
                self._reply(200, {"object": "chat.completion", "choices": [{"index": 0, "message": message}]})
            else:
                self._reply(404, {"error": {"message": f"no route {self.path}"}})

        def _reply(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
