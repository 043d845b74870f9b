"""The server against careless and hostile clients: oversized, slow, malformed, foreign and vanishing
requests, each answered with a clear error while the server stays healthy. A real uvicorn server on
loopback, a tiny random model, real sockets."""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import select
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("fastapi")

from eval_run_helpers import tiny_chat_model  # noqa: E402
from server_helpers import connect, read_response, request_bytes, running, sse_events  # noqa: E402

from rag_mspoe.connectors.server import create_app  # noqa: E402
from rag_mspoe.engine import Engine  # noqa: E402

MiB = 1 << 20


@pytest.fixture(scope="module")
def engine():
    return Engine(*tiny_chat_model(max_position_embeddings=4096), method="none")


def chat(engine: Engine, text: str = "hi", **extra) -> dict:
    return {
        "model": engine.name,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        "temperature": 0,  # greedy: the tiny model writes the same 1000 tokens every time
        **extra,
    }


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def test_an_oversized_chunked_body_is_refused_as_soon_as_it_passes_the_limit(engine):
    with running(create_app(engine, max_request_bytes=64 << 10)) as url, connect(url) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        for _ in range(4):  # four times the limit, and the body goes on: no last chunk is sent
            sock.sendall(b"10000\r\n" + b"x" * (64 << 10) + b"\r\n")
        status, headers, body = read_response(sock)
        assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
        assert headers["connection"] == "close"


def test_memory_stays_flat_under_a_stream_of_oversized_chunked_bodies(engine):
    def huge_body():  # 64 MiB as a generator: httpx sends it chunked, without Content-Length
        chunk = b"x" * (64 << 10)
        for _ in range(1024):
            yield chunk

    with running(create_app(engine, max_request_bytes=64 << 10)) as url:
        before = peak_rss_bytes()
        with httpx.Client(timeout=30) as client:
            for _ in range(5):
                response = client.post(f"{url}/v1/chat/completions", content=huge_body())
                assert response.status_code == 413  # read by a client that sends its whole body first
        assert peak_rss_bytes() - before < 32 * MiB
        assert httpx.post(f"{url}/v1/chat/completions", json=chat(engine)).status_code == 200


def trickle(sock: socket.socket, piece: bytes, seconds: float) -> float:
    """Send `piece` every 0.05 s until the server answers; seconds until it did."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            sock.sendall(piece)
        except OSError:  # the server closed its side: its answer is waiting
            break
        if select.select([sock], [], [], 0.05)[0]:
            break
    return time.monotonic() - start


@pytest.mark.parametrize("chunked", [False, True])
def test_a_slow_body_gets_a_408_within_the_body_deadline(engine, chunked):
    with running(create_app(engine, body_timeout_s=0.5)) as url, connect(url) as sock:
        if chunked:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            piece = b"1\r\n \r\n"
        else:
            sock.sendall(request_bytes("/v1/chat/completions", b" " * 10_000)[:-9_990])
            piece = b" "
        waited = trickle(sock, piece, seconds=5)  # a byte at a time keeps the connection busy
        status, headers, body = read_response(sock)
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
        assert headers["connection"] == "close"
        assert 0.4 < waited < 2


def test_unexpected_errors_are_a_generic_500_logged_in_full_and_the_connection_stays_usable(
    engine, monkeypatch, caplog
):
    def broken(*_args, **_kwargs):
        raise RuntimeError("tensor shape mismatch at internal/secret.py:42")

    with running(create_app(engine)) as url, connect(url) as sock:
        body = json.dumps(chat(engine)).encode()
        with monkeypatch.context() as patch, caplog.at_level(logging.ERROR):
            patch.setattr(engine, "generate", broken)
            sock.sendall(request_bytes("/v1/chat/completions", body))
            status, _, reply = read_response(sock)
        assert status == 500
        assert "secret" not in reply.decode() and json.loads(reply)["error"]["type"] == "server_error"
        assert "internal/secret.py:42" in caplog.text  # the detail is in the server's log
        sock.sendall(request_bytes("/v1/chat/completions", body))  # same keep-alive connection
        status, _, reply = read_response(sock)
        assert status == 200 and json.loads(reply)["choices"][0]["message"]["content"] is not None


CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
CLIENT_ERRORS = [
    # path, body, the field the error names, a word the message holds
    (TEXT, {"prompt": ""}, "prompt", "empty"),
    (TEXT, {"prompt": [""]}, "prompt", "empty"),
    (TEXT, {"prompt": 5}, "prompt", "string"),
    (TEXT, {"prompt": [1, 2, 3]}, "prompt", "string"),
    (TEXT, {"prompt": "word " * 5000}, "prompt", "4096"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 5000}]}, "messages", "4096"),
    (CHAT, {"messages": "hi"}, "messages", "array"),
    (CHAT, {"messages": []}, "messages", "at least 1"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "string"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "mood": "x"}]}, "messages.0.mood", "Unknown"),
    (CHAT, {"messages": HI, "frequency_penalty": 0.5}, "frequency_penalty", "Unknown"),
    (CHAT, {"messages": HI, "max_tokens": "ten"}, "max_tokens", "integer"),
    (CHAT, {"messages": HI, "max_tokens": 65}, "max_tokens", "64"),
    (CHAT, {"messages": HI, "temperature": "hot"}, "temperature", "number"),
    (CHAT, {"messages": HI, "stream": "yes"}, "stream", "boolean"),
    (CHAT, {"messages": HI, "seed": -1}, "seed", "greater"),
    (CHAT, {"messages": HI, "seed": 1 << 70}, "seed", "less"),
    (CHAT, {"messages": HI, "stop": [""]}, "stop", "non-empty"),
    (CHAT, {"messages": HI, "model": 5}, "model", "string"),
]


def test_client_errors_are_400s_naming_the_field_on_a_connection_that_stays_usable(engine):
    with running(create_app(engine, max_tokens_limit=64)) as url, connect(url) as sock:
        for path, fields, field, word in CLIENT_ERRORS:
            sock.sendall(request_bytes(path, json.dumps({"model": engine.name, **fields}).encode()))
            status, _, reply = read_response(sock)
            error = json.loads(reply)["error"]
            assert (status, error["param"]) == (400, field), (fields, error)
            assert word in error["message"] and field.split(".")[-1] in error["message"], error
        for body, words in [(b"{not json", "not valid JSON"), (b"[1]", "JSON object"), (b"[" * 5000, "JSON")]:
            sock.sendall(request_bytes(CHAT, body))
            status, _, reply = read_response(sock)
            assert status == 400 and words in json.loads(reply)["error"]["message"]
        sock.sendall(
            request_bytes(TEXT, json.dumps({"model": engine.name, "prompt": "hi", "max_tokens": 2}).encode())
        )
        assert read_response(sock)[0] == 200  # the same keep-alive connection, after 22 errors


LONG = 1000  # tokens: at least ten seconds of writing at the pace `forward_lengths` sets
TOKEN_PACE = 0.01  # seconds each token's forward takes at least, so no machine is fast enough to
# write half of LONG before the server notices its client left (an idle machine wrote 520 once)


@contextlib.contextmanager
def forward_lengths(model) -> Iterator[list[int]]:
    """The input length of every forward the model runs: a prefill's is its prompt's length, a
    token's 1; each token's forward takes at least TOKEN_PACE."""
    lengths: list[int] = []

    def record(_module, args, kwargs, _output):
        ids = kwargs.get("input_ids", args[0] if args else None)
        lengths.append(int(ids.shape[1]))
        if lengths[-1] == 1:
            time.sleep(TOKEN_PACE)

    handle = model.register_forward_hook(record, with_kwargs=True)
    try:
        yield lengths
    finally:
        handle.remove()


def settles(lengths: list[int], within: float = 3.0) -> bool:
    """Whether the model stops running forwards (for 0.3 s) within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        seen = len(lengths)
        time.sleep(0.3)
        if len(lengths) == seen:
            return True
    return False


def answered_quickly(url: str, engine: Engine) -> bool:
    start = time.monotonic()
    response = httpx.post(f"{url}/v1/chat/completions", json=chat(engine, max_tokens=2), timeout=30)
    return response.status_code == 200 and time.monotonic() - start < 2


@pytest.mark.parametrize("max_batch_size", [1, 4])
def test_a_stream_whose_client_disconnects_stops_between_tokens(engine, max_batch_size):
    app = create_app(engine, max_tokens_limit=LONG, max_batch_size=max_batch_size)
    with running(app) as url, forward_lengths(engine.model) as lengths:
        body = chat(engine, max_tokens=LONG, stream=True)
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            for n, _ in enumerate(response.iter_lines()):
                if n == 6:
                    break  # leaves mid-stream: the connection closes
        assert settles(lengths) and len(lengths) < LONG / 2
        assert answered_quickly(url, engine)


@pytest.mark.parametrize("max_batch_size", [1, 4])
def test_a_non_streamed_request_whose_client_gave_up_is_cancelled(engine, max_batch_size):
    app = create_app(engine, max_tokens_limit=LONG, max_batch_size=max_batch_size)
    with running(app) as url, forward_lengths(engine.model) as lengths:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/chat/completions", json=chat(engine, max_tokens=LONG), timeout=0.5)
        assert settles(lengths) and len(lengths) < LONG / 2
        assert answered_quickly(url, engine)


def test_a_tool_calling_request_whose_client_gave_up_is_cancelled(engine):
    tool = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}
    body = chat(engine, max_tokens=LONG, tools=[tool], tool_choice="auto")
    with running(create_app(engine, max_tokens_limit=LONG)) as url, forward_lengths(engine.model) as lengths:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=0.5)
        assert settles(lengths) and len(lengths) < LONG / 2
        assert answered_quickly(url, engine)


@pytest.mark.parametrize("max_batch_size", [1, 4])
@pytest.mark.parametrize("stream", [False, True])
def test_a_queued_request_whose_client_left_never_starts_its_prefill(engine, stream, max_batch_size):
    queued_text = "word " * 300
    queued_tokens = engine.count_tokens(queued_text)
    app = create_app(engine, max_tokens_limit=LONG, max_batch_size=max_batch_size)
    with running(app) as url, forward_lengths(engine.model) as lengths:
        busy = chat(engine, "keep the model busy", max_tokens=LONG, stream=True)
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=busy) as first:
            lines = first.iter_lines()
            next(lines), next(lines)  # the first request is generating
            with connect(url) as sock:
                queued = chat(engine, queued_text, max_tokens=8, stream=stream)
                sock.sendall(request_bytes("/v1/chat/completions", json.dumps(queued).encode()))
                time.sleep(0.3)  # waits behind the first
            time.sleep(0.3)  # its client has gone; then the first one leaves too
        assert settles(lengths)
        assert queued_tokens not in lengths
        assert answered_quickly(url, engine)
        httpx.post(f"{url}/v1/chat/completions", json=chat(engine, queued_text, max_tokens=1))
        assert queued_tokens in lengths  # the probe does see such a prefill when it runs


@pytest.mark.parametrize("max_batch_size", [1, 4])
def test_generation_past_the_request_deadline_is_a_503_or_an_error_event(engine, max_batch_size):
    app = create_app(engine, max_tokens_limit=LONG, request_timeout_s=0.5, max_batch_size=max_batch_size)
    with running(app) as url, forward_lengths(engine.model) as lengths:
        start = time.monotonic()
        response = httpx.post(f"{url}/v1/chat/completions", json=chat(engine, max_tokens=LONG), timeout=30)
        assert response.status_code == 503 and time.monotonic() - start < 3
        error = response.json()["error"]
        assert error["code"] == "timeout" and "0.5 s" in error["message"]
        streamed = httpx.post(f"{url}/v1/chat/completions", json=chat(engine, max_tokens=LONG, stream=True))
        assert sse_events(streamed.text)[-1]["error"]["code"] == "timeout"
        assert settles(lengths) and len(lengths) < LONG


def raw_exchange(url: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    with connect(url) as sock:
        sock.sendall(request)
        return read_response(sock)


def get(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"GET {path} HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_only_loopback_host_names_are_answered_by_default(engine):
    with running(create_app(engine)) as url:
        port = url.rsplit(":", 1)[1]
        for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
            assert raw_exchange(url, get("/v1/models", {"Host": host}))[0] == 200, host
        for host in ("evil.example", f"evil.example:{port}", "localhost.evil.example", "127.0.0.2", ""):
            status, _, body = raw_exchange(url, get("/v1/models", {"Host": host}))
            error = json.loads(body)["error"]
            assert (status, error["code"]) == (403, "host_not_allowed"), host
            assert "--allowed-host" in error["message"]


def test_a_cross_origin_post_is_refused_before_it_reaches_the_model(engine):
    body = json.dumps(chat(engine)).encode()
    with running(create_app(engine)) as url, forward_lengths(engine.model) as lengths:
        for origin in ("https://evil.example", "null", "http://localhost:1"):
            # text/plain: what a web page may send without a CORS preflight
            request = request_bytes("/v1/chat/completions", body, {"Origin": origin})
            status, headers, reply = raw_exchange(url, request.replace(b"application/json", b"text/plain"))
            error = json.loads(reply)["error"]
            assert (status, error["code"]) == (403, "origin_not_allowed") and "--cors-origin" in error[
                "message"
            ]
            assert "access-control-allow-origin" not in headers
        assert lengths == []
        same_origin = request_bytes("/v1/chat/completions", body, {"Origin": url})
        host = url.removeprefix("http://").encode()
        assert raw_exchange(url, same_origin.replace(b"127.0.0.1", host, 1))[0] == 200  # a page it served


def test_allowed_hosts_and_cors_origins_widen_the_defaults(engine):
    app = create_app(engine, allowed_hosts=["api.example"], cors_origins=["https://app.example/"])
    with running(app) as url:
        assert raw_exchange(url, get("/v1/models", {"Host": "api.example:443"}))[0] == 200
        assert raw_exchange(url, get("/v1/models", {"Host": "localhost"}))[0] == 403  # replaced, not added
        preflight = get("/v1/chat/completions", {"Host": "api.example", "Origin": "https://app.example"})
        preflight = preflight.replace(b"GET", b"OPTIONS") + b""
        preflight = preflight.replace(b"\r\n\r\n", b"\r\nAccess-Control-Request-Method: POST\r\n\r\n")
        status, headers, _ = raw_exchange(url, preflight)
        assert status == 204 and headers["access-control-allow-origin"] == "https://app.example"
        assert "authorization" in headers["access-control-allow-headers"]
        body = json.dumps(chat(engine)).encode()
        post = request_bytes("/v1/chat/completions", body, {"Origin": "https://app.example"})
        status, headers, _ = raw_exchange(url, post.replace(b"Host: 127.0.0.1", b"Host: api.example"))
        assert status == 200 and headers["access-control-allow-origin"] == "https://app.example"
        post = request_bytes("/v1/chat/completions", body, {"Origin": "https://other.example"})
        assert raw_exchange(url, post.replace(b"Host: 127.0.0.1", b"Host: api.example"))[0] == 403


def test_the_bearer_token_scheme_is_case_insensitive_and_a_wrong_token_is_refused(engine):
    with running(create_app(engine, api_key="s3cret")) as url:
        for value in ("Bearer s3cret", "bearer s3cret", "BEARER  s3cret"):
            assert (
                raw_exchange(url, get("/v1/models", {"Host": "localhost", "Authorization": value}))[0] == 200
            )
        for value in ("Bearer wrong", "Bearer s3cret2", "Basic s3cret", "s3cret", "Bearer ", "Bearer \xfc"):
            status, _, body = raw_exchange(
                url, get("/v1/models", {"Host": "localhost", "Authorization": value})
            )
            assert (status, json.loads(body)["error"]["code"]) == (401, "invalid_api_key"), value
        assert raw_exchange(url, get("/v1/models", {"Host": "localhost"}))[0] == 401
        assert raw_exchange(url, get("/health", {"Host": "localhost"}))[0] == 200  # health needs no key


def test_a_model_name_the_server_does_not_list_is_a_404(engine):
    with running(create_app(engine)) as url:
        listed = {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
        for model in (f"{engine.name}+", f"{engine.name}+none+", f"{engine.name}++pi", f"{engine.name}+pi:2"):
            assert model not in listed
            response = httpx.post(f"{url}/v1/chat/completions", json={**chat(engine), "model": model})
            error = response.json()["error"]
            assert (response.status_code, error["code"], error["param"]) == (404, "model_not_found", "model")
            assert "available:" in error["message"]
        assert httpx.post(f"{url}/v1/chat/completions", json=chat(engine)).status_code == 200


def test_unknown_routes_and_methods_answer_in_the_openai_error_shape(engine):
    with running(create_app(engine)) as url:
        for method, path, status, code in [
            ("GET", "/v1/nothing", 404, "not_found"),
            ("POST", "/v1/embeddings", 404, "not_found"),
            ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
            ("DELETE", "/v1/models", 405, "method_not_allowed"),
        ]:
            response = httpx.request(method, f"{url}{path}")
            body = response.json()
            assert set(body) == {"error"}, body
            assert set(body["error"]) == {"message", "type", "param", "code"}
            assert (response.status_code, body["error"]["code"]) == (status, code), (method, path)
            assert "POST /v1/chat/completions" in body["error"]["message"]
        assert "POST" in httpx.get(f"{url}/v1/chat/completions").headers["allow"]


def read_final_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The first non-1xx response on the socket (HTTP/1.1 clients skip interim answers)."""
    while True:
        status, headers, body = read_response(sock)
        if status >= 200:
            return status, headers, body


@pytest.mark.parametrize("closing", ["keep-alive", "Connection: close", "HTTP/1.0"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_client_that_half_closes_after_its_request_gets_its_answer(engine, path, closing):
    body = chat(engine) if path.endswith("chat/completions") else {"model": engine.name, "prompt": "hi"}
    headers = {"Connection": "close"} if closing == "Connection: close" else {}
    request = request_bytes(path, json.dumps({**body, "max_tokens": 4}).encode(), headers)
    if closing == "HTTP/1.0":
        request = request.replace(b"HTTP/1.1", b"HTTP/1.0", 1)
    with running(create_app(engine)) as url, connect(url) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)  # nothing more to send; still reading
        status, headers, reply = read_final_response(sock)
        assert status == 200 and json.loads(reply)["usage"]["completion_tokens"] == 4
        assert sock.recv(1) == b""  # and then the server closes


@pytest.mark.parametrize("headers", [{}, {"Connection": "close"}])
def test_a_client_that_closes_completely_still_has_its_generation_stopped(engine, headers):
    with running(create_app(engine, max_tokens_limit=LONG)) as url, forward_lengths(engine.model) as lengths:
        sock = connect(url)
        body = json.dumps(chat(engine, max_tokens=LONG)).encode()
        sock.sendall(request_bytes("/v1/chat/completions", body, headers))
        time.sleep(0.3)  # generating
        sock.close()
        assert settles(lengths) and len(lengths) < LONG / 2
        assert answered_quickly(url, engine)


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes the connection within `within` seconds (what it sent before is read)."""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    return True


@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"])
def test_a_connection_whose_headers_never_finish_gets_a_408_and_is_closed(engine, sent):
    with running(create_app(engine), header_timeout_s=0.5) as url, connect(url) as sock:
        start = time.monotonic()
        sock.sendall(sent)
        if sent:
            status, _, body = read_response(sock)
            assert status == 408 and b"headers took too long" in body
        assert closed_by_server(sock, within=3) and time.monotonic() - start < 3
        assert answered_quickly(url, engine)


def test_headers_trickled_within_the_deadline_and_a_long_answer_are_not_cut(engine):
    request = request_bytes("/v1/chat/completions", json.dumps(chat(engine, max_tokens=150)).encode())
    app = create_app(engine, max_tokens_limit=LONG)
    with running(app, header_timeout_s=1.0) as url, connect(url) as sock, forward_lengths(engine.model):
        for start in range(0, len(request), 40):  # slow, but whole within the deadline
            sock.sendall(request[start : start + 40])
            time.sleep(0.02)
        began = time.monotonic()
        status, _, body = read_response(sock)  # 150 paced tokens: longer than the header deadline
        assert status == 200 and time.monotonic() - began > 1.0
        assert json.loads(body)["choices"][0]["finish_reason"] == "length"


def test_a_kept_alive_connection_whose_next_headers_trickle_too_slowly_gets_a_408(engine):
    request = request_bytes("/v1/chat/completions", json.dumps(chat(engine)).encode())
    with running(create_app(engine), header_timeout_s=0.5) as url, connect(url) as sock:
        sock.sendall(request)
        assert read_response(sock)[0] == 200
        for byte in request[:30]:  # a byte every 0.1 s: the old keep-alive clock would never fire
            sock.sendall(bytes([byte]))
            time.sleep(0.1)
            if select.select([sock], [], [], 0)[0]:
                break
        status, _, _ = read_response(sock)
        assert status == 408 and closed_by_server(sock, within=3)


def test_one_address_past_its_connection_limit_gets_a_429_while_other_addresses_are_served(engine):
    with running(create_app(engine), max_connections_per_client=2) as url:
        idle = [connect(url) for _ in range(2)]
        time.sleep(0.2)
        with connect(url) as sock:  # a third from 127.0.0.1: refused before it sends anything
            status, headers, body = read_response(sock)
            assert status == 429 and b"Too many open connections" in body
            assert closed_by_server(sock, within=3)
        with connect(url, from_address="127.0.0.2") as sock:  # another address is served
            sock.sendall(request_bytes("/v1/chat/completions", json.dumps(chat(engine)).encode()))
            assert read_response(sock)[0] == 200
        idle[0].close()
        time.sleep(0.2)
        assert answered_quickly(url, engine)  # a slot of 127.0.0.1 came free
        idle[1].close()


@pytest.mark.parametrize("limit", [0, -1, 1.5, True])
def test_a_bad_per_client_limit_is_refused_by_name(limit):
    from rag_mspoe.connectors.client_limit import protocol_with

    with pytest.raises(ValueError, match="max_connections_per_client"):
        protocol_with(30.0, limit)


def test_connections_past_the_limit_get_a_503_until_others_close(engine):
    with running(create_app(engine), max_connections=3) as url:
        idle = [connect(url) for _ in range(3)]
        time.sleep(0.2)
        with connect(url) as sock:
            sock.sendall(request_bytes("/v1/chat/completions", json.dumps(chat(engine)).encode()))
            assert read_response(sock)[0] == 503
        for sock in idle:
            sock.close()
        time.sleep(0.2)
        assert answered_quickly(url, engine)


def _called(arguments: str) -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "ok"},
    ]


def test_malformed_tool_call_history_is_a_400_naming_it_and_logs_no_traceback(engine, caplog):
    deep = '{"a": ' + "[" * 600 + "]" * 600 + "}"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with running(create_app(engine)) as url, caplog.at_level(logging.INFO):
        for arguments, words in [
            (deep, "nest deeper than 64 levels"),
            ('{"a": "\\ud800"}', "lone surrogate"),
        ]:
            for extra in ({}, {"tools": [tool]}, {"stream": True}):
                response = httpx.post(f"{url}{CHAT}", json=chat(engine, messages=_called(arguments), **extra))
                error = response.json()["error"]
                assert (response.status_code, error["param"]) == (400, "messages"), (words, extra, error)
                assert words in error["message"] and "TextEncodeInput" not in error["message"]
        assert "Traceback" not in caplog.text
        assert (
            httpx.post(f"{url}{CHAT}", json=chat(engine, messages=_called('{"a": [1]}'))).status_code == 200
        )


def test_a_temperature_too_small_to_sample_at_decodes_greedily(engine):
    with running(create_app(engine)) as url:
        greedy = httpx.post(f"{url}{CHAT}", json=chat(engine, max_tokens=8)).json()
        for temperature in (1e-45, 1e-38, 1e-6):
            body = chat(engine, max_tokens=8, temperature=temperature, seed=1)
            response = httpx.post(f"{url}{CHAT}", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"] == greedy["choices"][0]["message"]
            streamed = httpx.post(f"{url}{CHAT}", json={**body, "stream": True})
            events = sse_events(streamed.text)
            assert all("error" not in event for event in events), events[-1]
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
            assert text == greedy["choices"][0]["message"]["content"]


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def test_a_schema_no_value_fits_or_too_many_references_is_a_400_and_the_server_lives(engine):
    chain = {
        f"a{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/a{i + 1}"}}} for i in range(3000)
    }
    schemas = {
        "leads back to itself": {"$ref": "#"},
        "leads back": {
            "$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]}, "b": {"$ref": "#/$defs/a"}},
            "$ref": "#/$defs/a",
        },
        "3001 different $refs": {"$defs": {**chain, "a3000": {"type": "string"}}, "$ref": "#/$defs/a0"},
    }
    with running(create_app(engine)) as url:
        for words, schema in schemas.items():
            for where in ("response_format", "tools"):
                if where == "tools":
                    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
                    extra: dict = {"tools": [tool], "tool_choice": "required"}
                else:
                    extra = {"response_format": _schema_format(schema)}
                response = httpx.post(f"{url}{CHAT}", json=chat(engine, **extra), timeout=60)
                error = response.json()["error"]
                assert (response.status_code, error["param"]) == (400, where), (words, where, error)
                assert words in error["message"], error
        tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
        body = chat(engine, response_format=_schema_format(tree), max_tokens=16)
        assert httpx.post(f"{url}{CHAT}", json=body).status_code == 200  # recursion that reads something


def test_a_name_is_read_on_tool_messages_and_refused_where_it_would_be_dropped(engine):
    with running(create_app(engine)) as url:
        assert httpx.post(f"{url}{CHAT}", json=chat(engine, messages=_called('{"a": 1}'))).status_code == 200
        for role in ("user", "system", "assistant"):
            messages = [{"role": role, "content": "hi", "name": "bob"}, {"role": "user", "content": "hi"}]
            response = httpx.post(f"{url}{CHAT}", json=chat(engine, messages=messages))
            error = response.json()["error"]
            assert (response.status_code, error["param"]) == (400, "messages.0.name")
            assert "would be dropped" in error["message"]
