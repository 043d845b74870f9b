"""HTTP requests to an OpenAI-compatible server (vLLM, llama.cpp's server, `rag-mspoe serve`, a
hosted API): concurrency, retries with backoff, a request budget, and one probe of what it can do.

    client = RemoteClient(Endpoint("http://gpu-box:8000/v1", "Qwen/Qwen2.5-7B-Instruct"))
    client.post("/completions", {"prompt": "Paris is", "max_tokens": 5})

Standard library only: the evaluation and the adapters use it without another extra.
A request is retried, after 0.5 s, 1 s, 2 s, ... (`backoff_s` doubled each time), when the
connection fails or the server answers 408, 429 or 5xx: what a loaded server or a restarting
replica says. Other errors (a wrong model name, a bad field) are the caller's and fail at once.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")
R = TypeVar("R")
RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# The probe's prompt: long enough that every tokenizer gives it several tokens.
PROBE_PROMPT = "The capital of France is Paris, and the capital of Italy is Rome."


class EndpointError(RuntimeError):
    """The server refused a request (`status`: its HTTP status), or could not be reached after
    every retry (`status` None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class EndpointTimeout(EndpointError, TimeoutError):
    """The server did not answer (or stream its answer) before the caller's deadline."""


class RequestBudgetSpent(RuntimeError):
    """The run's request budget is spent; a rerun of the same command goes on from there."""


@dataclass(frozen=True)
class Endpoint:
    """Where the server is and how to talk to it.

    url: the API's base ("http://host:8000/v1"; a bare "http://host:8000" gets "/v1").
    model: the name the server knows the model by. concurrency: requests in flight at once.
    retries: further attempts of a failed request. max_requests: requests this client may send in
    all, retries included (None: no limit).
    """

    url: str
    model: str
    api_key: str | None = None
    concurrency: int = 4
    retries: int = 4
    backoff_s: float = 0.5
    timeout_s: float = 600.0
    max_requests: int | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(
                f"--endpoint {self.url!r} is not an http(s) URL; give the API's base, "
                "e.g. http://127.0.0.1:8000/v1."
            )
        if not self.model:
            raise ValueError("Name the served model (--model NAME), as the server's /v1/models lists it.")
        if self.concurrency < 1 or self.retries < 0:
            raise ValueError(
                f"concurrency must be >= 1 and retries >= 0, got {self.concurrency} and {self.retries}."
            )
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"The request budget must be at least 1, got {self.max_requests}.")

    @property
    def base(self) -> str:
        url = self.url.rstrip("/")
        return url + "/v1" if urlsplit(url).path in ("", "/") else url


class RemoteClient:
    """Sends JSON requests to one endpoint, `concurrency` at a time, within the request budget."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._pool = ThreadPoolExecutor(endpoint.concurrency, thread_name_prefix="remote")
        self._count_lock = threading.Lock()
        self.sent = 0  # requests sent, retries included

    def post(self, path: str, body: dict[str, Any], *, deadline: float | None = None) -> dict[str, Any]:
        """The JSON answer of POST `path` (under the base URL) with `body` and the model's name.

        deadline: a `time.monotonic()` time by which the answer must have come, or EndpointTimeout
        (no retry after it)."""
        data = self._opened(path, body, deadline, whole=True)
        try:
            return dict(json.loads(data))
        except ValueError as exc:  # a proxy's HTML page, say
            raise EndpointError(
                f"{self.endpoint.base}{path} answered with something that is not JSON ({data[:200]!r}); "
                "is --endpoint the API's base URL (.../v1)?"
            ) from exc

    def events(
        self, path: str, body: dict[str, Any], *, deadline: float | None = None
    ) -> Generator[dict[str, Any], None, None]:
        """The server-sent events of a streamed POST `path`, as JSON, until `data: [DONE]`.

        Only opening the stream is retried: once text has come, a failure ends the stream. An
        error the server reports inside the stream (OpenAI's {"error": ...}) is raised as
        EndpointError. deadline: as `post`'s, checked at every event too."""
        with self._opened(path, {**body, "stream": True}, deadline, whole=False) as response:
            for line in _lines(response, f"{self.endpoint.base}{path}", deadline):
                if deadline is not None and time.monotonic() > deadline:
                    raise EndpointTimeout(f"{self.endpoint.base}{path} streamed past the deadline.")
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments and event names
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                event = dict(json.loads(data))
                if event.get("error"):
                    message = _error_message(data)
                    raise EndpointError(f"{self.endpoint.base}{path} failed mid-stream: {message}")
                yield event

    def map(self, function: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """function(item) for every item, `concurrency` at a time, in order; the first error is raised."""
        return list(self._pool.map(function, items))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _spend_one(self) -> None:
        with self._count_lock:
            budget = self.endpoint.max_requests
            if budget is not None and self.sent >= budget:
                raise RequestBudgetSpent(
                    f"The request budget of {budget} is spent; rerun the same command (with a new "
                    "--max-requests) to go on."
                )
            self.sent += 1

    def _opened(self, path: str, body: dict[str, Any], deadline: float | None, whole: bool) -> Any:
        """POST `path`, retried as the module says: the answer's bytes (whole) or the open response."""
        payload = json.dumps({"model": self.endpoint.model, **body}).encode()
        delay, attempt = self.endpoint.backoff_s, 0
        while True:
            self._spend_one()
            try:
                return self._open(path, payload, deadline, whole)
            except _Retryable as exc:
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise EndpointTimeout(
                        f"{self.endpoint.base}{path} did not answer before the deadline, last: {exc}"
                    ) from exc
                if attempt == self.endpoint.retries:
                    raise EndpointError(
                        f"{self.endpoint.base}{path} failed {attempt + 1} times, last: {exc}; check that "
                        "the server is up, or raise --retries."
                    ) from exc
            time.sleep(delay)
            delay, attempt = delay * 2, attempt + 1

    def _open(self, path: str, payload: bytes, deadline: float | None, whole: bool) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.endpoint.api_key:
            headers["Authorization"] = f"Bearer {self.endpoint.api_key}"
        request = urllib.request.Request(self.endpoint.base + path, payload, headers, method="POST")
        timeout = self.endpoint.timeout_s
        if deadline is not None:
            timeout = min(timeout, deadline - time.monotonic())
            if timeout <= 0:
                raise EndpointTimeout(f"{self.endpoint.base}{path}: the deadline passed before the request.")
        try:
            response = urllib.request.urlopen(request, timeout=timeout)
            if not whole:
                return response
            with response:
                return response.read()
        except urllib.error.HTTPError as exc:
            detail = _error_message(exc.read())
            if exc.code in RETRIED_STATUSES:
                raise _Retryable(f"HTTP {exc.code}: {detail}") from exc
            message = f"{self.endpoint.base}{path} answered HTTP {exc.code}: {detail}"
            raise EndpointError(message, exc.code) from exc
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            if deadline is not None and isinstance(reason, TimeoutError):
                message = f"{self.endpoint.base}{path} did not answer before the deadline."
                raise EndpointTimeout(message) from exc
            raise _Retryable(str(reason)) from exc


def _lines(response: Any, url: str, deadline: float | None) -> Iterator[bytes]:
    """The lines of a streamed answer; a connection that breaks or stalls ends it with EndpointError."""
    try:
        yield from response
    except (ConnectionError, TimeoutError) as exc:
        if deadline is not None and isinstance(exc, TimeoutError):
            raise EndpointTimeout(f"{url} stopped streaming before the deadline.") from exc
        raise EndpointError(f"{url} broke off its stream: {exc}") from exc


class _Retryable(Exception):
    """A failure worth another attempt."""


def _error_message(body: bytes) -> str:
    """The message of an error answer: OpenAI's {"error": {"message"}} or the body as text."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body.decode(errors="replace")[:500]
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return str(error)[:500]


def prompt_logprobs(client: RemoteClient, text: str) -> list[float | None]:
    """The log-probability of each of the server's tokens of `text` given the tokens before it (None
    for the first, which nothing predicts, or where none came back): completions with echo and
    logprobs, and one generated token, dropped (`usage.completion_tokens` says how many came)."""
    return _prompt_values(_echoed(client, text, top=0))


def has_prompt_logprobs(client: RemoteClient) -> bool:
    """Whether the server scores a prompt's own tokens (echo with logprobs): vLLM and `rag-mspoe
    serve` do; llama.cpp's server gives 0.0 or nothing for them, which would turn every
    log-likelihood into a tie, and llama-cpp-python's scores each token by the distribution after
    it (one token off), which `greedy_is_likeliest` finds. One request."""
    try:
        answer = _echoed(client, PROBE_PROMPT, top=1)
    except EndpointError as exc:
        if exc.status in (400, 422):  # a server that refuses echo or logprobs outright
            return False
        raise  # unreachable, a wrong key or model name: said as the server says it
    values = _prompt_values(answer)
    scored = [value for value in values[1:] if value is not None and math.isfinite(value)]
    return len(scored) >= 2 and any(value < 0 for value in scored) and greedy_is_likeliest(answer)


def greedy_is_likeliest(answer: dict[str, Any]) -> bool:
    """Whether a greedy completion's one generated token has the highest log-probability of its
    step's alternatives (True where the server lists none). Scores that are aligned with their
    tokens pass; scores shifted by one token (each token given the distribution that follows it)
    fail it but for a coincidence."""
    choice = answer["choices"][0]
    logprobs = choice.get("logprobs") or {}
    values, tops = logprobs.get("token_logprobs") or [], logprobs.get("top_logprobs") or []
    generated = int((answer.get("usage") or {}).get("completion_tokens", 1))
    if generated != 1 or not values or len(tops) != len(values) or not tops[-1]:
        return True
    return values[-1] is not None and float(values[-1]) >= max(map(float, tops[-1].values())) - 1e-3


def _echoed(client: RemoteClient, text: str, top: int) -> dict[str, Any]:
    body = {"prompt": text, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": top}
    return client.post("/completions", body)


def _prompt_values(answer: dict[str, Any]) -> list[float | None]:
    values = (answer["choices"][0].get("logprobs") or {}).get("token_logprobs") or []
    generated = int((answer.get("usage") or {}).get("completion_tokens", 1))
    prompt = values[: len(values) - generated] if generated else values
    return [None if value is None else float(value) for value in prompt]
