"""A corpus of malformed and odd requests against a real server: every one gets an answer or a 4xx
in the OpenAI error shape, never a 5xx, and the server answers normally after all of them. The
tool calls and document spans the library refuses come back as 400s that say what to change."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from eval_run_helpers import tiny_chat_model  # noqa: E402
from server_helpers import running, sse_events  # noqa: E402

from rag_mspoe.connectors.server import create_app  # noqa: E402
from rag_mspoe.engine import Engine  # noqa: E402

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
DOCUMENTS = "Document [1] a\nDocument [2] b"
DOCUMENT_METHODS = ("", "+none", "+pine", "+attention-calibration")


@pytest.fixture(scope="module")
def engine():
    return Engine(*tiny_chat_model(max_position_embeddings=4096), method="none")


def chat(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def called(arguments: Any, name: str = "get_weather") -> list[dict[str, Any]]:
    """A conversation whose assistant turn called a tool with these arguments."""
    call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]


def function(parameters: Any = None, **fields: Any) -> dict[str, Any]:
    body = {"name": "f", **fields, **({} if parameters is None else {"parameters": parameters})}
    return {"type": "function", "function": body}


def schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


DEEP = b"[" * 10_000 + b"]" * 10_000
# Request bodies (dicts without "model", which the test adds, or raw bytes) on each path.
REQUESTS: list[tuple[str, dict[str, Any] | bytes]] = [
    *[(CHAT, chat(n=n)) for n in (2, 0, -1)],
    *[(CHAT, chat(max_tokens=value)) for value in (0, -5, 10**12, 1.5, True, None)],
    *[(CHAT, chat(temperature=value)) for value in (float("nan"), float("inf"), -1, 3, "hot", None)],
    *[(CHAT, chat(top_p=value)) for value in (0, 1.5, float("nan"))],
    (TEXT, {"prompt": ["hi"] * 33, "max_tokens": 2}),
    (TEXT, {"prompt": [], "max_tokens": 2}),
    (TEXT, {"prompt": [["nested"]], "max_tokens": 2}),
    (TEXT, {"prompt": "hi", "max_tokens": 2, "logprobs": 6}),
    (TEXT, {"prompt": "hi", "max_tokens": 2, "echo": True, "logprobs": 2, "stream": True}),
    (CHAT, chat(logprobs=True, top_logprobs=21)),
    (CHAT, chat(top_logprobs=2)),
    (CHAT, chat(stop=["a"] * 5)),
    (CHAT, chat(stop=5)),
    (CHAT, chat(stream_options={"include_usage": "yes"})),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}),
    (CHAT, {"messages": [{"role": "user"}], "max_tokens": 2}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 3}], "max_tokens": 2}),
    (CHAT, {"messages": [{"role": "user", "content": None}], "max_tokens": 2}),
    (CHAT, {"messages": [{"role": "tool", "content": "a result nobody asked for"}], "max_tokens": 2}),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "tool_calls": called("{}")[1]["tool_calls"]}]}),
    (CHAT, {"messages": [{"role": "assistant", "content": "only me"}], "max_tokens": 2}),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "\x00\ud800 a NUL and a lone surrogate"}], "max_tokens": 2},
    ),
    (CHAT, b'{"messages": [{"role": "user", "content": ' + DEEP + b"}]}"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe not UTF-8"}]}'),
    (CHAT, b"\xff\xfe\x00"),
    (CHAT, b""),
    (CHAT, b"null"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e999}'),
    # An assistant turn's tool call with arguments that are not a JSON object: once a 500.
    *[
        (CHAT, {"messages": called(arguments), "max_tokens": 2, **tools})
        for arguments in ("{oops", "[1,2]", "5", "null", '"text"', "{}{}", "", {"city": "Paris"})
        for tools in ({}, {"tools": [WEATHER]})
    ],
    (CHAT, {"messages": called("{}", name=""), "max_tokens": 2}),
    *[
        (CHAT, chat(tools=[tool], tool_choice=choice))
        for tool in (
            function({"type": "object", "properties": {"a": {"type": "frobnicate"}}}),
            function({"type": "object", "properties": 5}),
            function({"type": "object", "required": ["a", "a"]}),
            function({"$ref": "#/nowhere"}),
            function({"type": "string"}),
            function({"allOf": [{"type": "string"}, {"type": "integer"}]}),
            function({"type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}),
            function(
                {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}}
            ),
            {"type": "function", "function": {"name": "has space"}},
            {"type": "function", "function": {}},
            {"type": "retrieval"},
        )
        for choice in ("auto", "required")
    ],
    (CHAT, chat(tools=[WEATHER, WEATHER])),
    (CHAT, chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "other"}})),
    (CHAT, chat(tools=[WEATHER], tool_choice="sometimes")),
    (CHAT, chat(tool_choice="auto")),
    (CHAT, chat(tools=[WEATHER], tool_choice="required", logprobs=True)),
    (CHAT, chat(tools=[WEATHER], response_format={"type": "json_object"})),
    *[
        (CHAT, chat(response_format=fmt))
        for fmt in (
            {"type": "json_schema"},
            {"type": "xml"},
            schema_format({"type": "frobnicate"}),
            schema_format({"allOf": [{"type": "string"}, {"type": "integer"}]}),
            schema_format({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
            schema_format({"type": "string", "pattern": "(("}),
            schema_format({"type": "string", "minLength": 5, "maxLength": 1}),
        )
    ],
]
# Document spans under the methods that read them and those that do not: out of range, overlapping,
# backwards, empty, not integers, and right. Out of range and overlapping were 500s under every method.
SPANS = ([[0, 999]], [[0, 14], [10, 20]], [[5, 1]], [[-1, 2]], [[0, 0]], [[1.5, 3]], [["a", "b"]])
SPANS += ([[0, 1, 2]], 7, [[0, 14], [15, 28]], [], [[12, 14]])  # type: ignore[assignment]
for _method in DOCUMENT_METHODS:
    REQUESTS += [
        *[
            (
                CHAT,
                {"model": _method, "messages": [{"role": "user", "content": DOCUMENTS, "document_spans": s}]},
            )
            for s in SPANS
        ],
        (CHAT, {"model": _method, "messages": [{"role": "user", "content": "no documents here"}]}),
        (
            CHAT,
            {"model": _method, "messages": [{"role": "user", "content": "   ", "document_spans": [[0, 3]]}]},
        ),
        (
            CHAT,
            {
                "model": _method,
                "messages": [{"role": "assistant", "content": DOCUMENTS, "document_spans": []}],
            },
        ),
        (TEXT, {"model": _method, "prompt": DOCUMENTS + "\nQ:"}),
        (TEXT, {"model": _method, "prompt": "no documents"}),
    ]


def sent(name: str, request: dict[str, Any] | bytes, stream: bool) -> bytes:
    """The body as bytes: the server's model name (a method's suffix added) and max_tokens filled in."""
    if isinstance(request, bytes):
        return (
            request.replace(b"{", b'{"model": "' + name.encode() + b'", ', 1)
            if request[:1] == b"{"
            else request
        )
    body = {"max_tokens": 2, "stream": stream, **request, "model": name + request.get("model", "")}
    return json.dumps(body).encode()  # NaN and Infinity as Python writes them, as some clients do


def assert_openai_error(response: httpx.Response, request: Any) -> None:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, request
    assert error["type"] == "invalid_request_error" and error["message"], request


@pytest.mark.parametrize("stream", [False, True])
def test_no_request_of_the_corpus_gets_a_5xx(engine, stream):
    with running(create_app(engine, max_tokens_limit=64)) as url, httpx.Client(timeout=120) as client:
        for path, request in REQUESTS:
            body = sent(engine.name, request, stream)
            response = client.post(url + path, content=body, headers={"Content-Type": "application/json"})
            assert response.status_code < 500, (request, response.text)
            if response.status_code >= 400:
                assert_openai_error(response, request)
            elif response.headers["content-type"].startswith("text/event-stream"):
                assert not [e for e in sse_events(response.text) if "error" in e], (request, response.text)
        assert client.post(url + CHAT, json={**chat(), "model": engine.name}).status_code == 200


@pytest.mark.parametrize(
    "request_body, words",
    [
        (
            {"messages": called("{oops")},
            ["Message 1", "call of 'get_weather'", "not JSON", "'{oops'", "JSON object"],
        ),
        ({"messages": called("[1,2]")}, ["Message 1", "must be a JSON object", "[1, 2]"]),
        ({"messages": called("[1,2]"), "tools": [WEATHER]}, ["Message 1", "must be a JSON object"]),
        *[
            (
                {
                    "model": method,
                    "messages": [{"role": "user", "content": DOCUMENTS, "document_spans": spans}],
                },
                ["Message 0", f"span [{spans[-1][0]}, {spans[-1][1]})", "overlaps", "once, in order"],
            )
            for method in ("+pine", "+attention-calibration")
            for spans in ([[0, 999]], [[0, 14], [10, 20]])
        ],
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_and_document_spans_the_library_refuses_are_400s_that_say_why(
    engine, request_body, words, stream
):
    with running(create_app(engine)) as url:
        response = httpx.post(
            url + CHAT,
            content=sent(engine.name, request_body, stream),
            headers={"Content-Type": "application/json"},
        )
    assert response.status_code == 400, response.text
    assert_openai_error(response, request_body)
    error = response.json()["error"]
    assert error["param"] == "messages" and all(word in error["message"] for word in words), error
