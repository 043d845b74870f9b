"""Tools and response_format on the OpenAI-compatible server, through the openai client and
ChatOpenAI, on a tiny random model: every call and every JSON answer is valid only because the
grammar makes it so."""

from __future__ import annotations

import copy
import json

import httpx
import jsonschema
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from server_helpers import running  # noqa: E402
from tiny_models import tiny_model  # noqa: E402

from rag_mspoe.connectors.server import create_app  # noqa: E402
from rag_mspoe.engine import Engine  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(embedded):
    tokenizer = embedded[1]
    model = tiny_model(
        "llama", vocab_size=len(tokenizer), max_position_embeddings=1024, initializer_range=0.3
    )
    return Engine(model, tokenizer, name="tiny")


@pytest.fixture(scope="module")
def base_url(engine):
    with running(create_app(engine, max_tokens_limit=256)) as url:
        yield url


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def parameters(name: str) -> dict:
    return next(t["function"]["parameters"] for t in (WEATHER, TIME) if t["function"]["name"] == name)


def test_tool_calls_come_back_in_the_openai_shape(client):
    for seed in range(2):
        reply = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=False,  # a random model would chain calls up to max_tokens
            max_tokens=120,
            seed=seed,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), parameters(call.function.name))
    named = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
    )
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_time"]


def test_a_conversation_with_tool_results_is_answered(client):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
    ]
    reply = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=6
    )
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


def test_streamed_tool_calls_assemble_to_the_same_calls(client):
    kwargs = dict(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        seed=3,
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    streamed: dict[int, dict] = {}
    pieces: list = []
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        pieces += delta.tool_calls or []
        for call in delta.tool_calls or []:
            streamed.setdefault(call.index, {"name": call.function.name, "arguments": ""})
            streamed[call.index]["arguments"] += call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole
    ]
    # Each call in one chunk, once written whole: a chunk cannot be taken back if max_tokens cuts it.
    assert len(pieces) == len(whole) and all(
        c.id and c.type == "function" and c.function.name for c in pieces
    )


def test_smollm2_streams_the_calls_it_answers(embedded):
    kwargs = dict(
        model=None,
        messages=[{"role": "user", "content": "What is the weather in Paris, in C?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
    )
    engine = Engine(*embedded)
    with running(create_app(engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        kwargs["model"] = engine.name
        whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
        streamed = openai.lib.streaming.chat.ChatCompletionStreamState()
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            streamed.handle_chunk(chunk)
    calls = streamed.get_final_completion().choices[0].message.tool_calls
    assert whole and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole
    ]


def test_a_template_that_refuses_the_messages_is_a_400_with_tools(engine):
    tokenizer = copy.copy(engine.tokenizer)
    tokenizer.chat_template = "{{ raise_exception('Conversations must open with a system turn') }}"
    refusing = Engine(engine.model, tokenizer, name="tiny")
    body = {"model": "tiny", "messages": ASK, "tools": [WEATHER], "tool_choice": "required"}
    with running(create_app(refusing)) as url:
        for stream in (False, True):
            response = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": stream})
            assert response.status_code == 400
            assert "refused these messages: Conversations must open" in response.json()["error"]["message"]


def test_response_format_json_schema_and_json_object(client):
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "A city?"}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": CITY, "strict": True},
        },
        max_tokens=120,
        temperature=1.0,
        seed=1,
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), CITY)
    anything = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "JSON?"}],
        response_format={"type": "json_object"},
        max_tokens=40,
    )
    assert anything.choices[0].message.content.startswith("{")


def structured_answer(client, schema: dict, **settings) -> object:
    """The JSON the server answers for a json_schema response_format."""
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Answer."}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        max_tokens=120,
        **settings,
    )
    return json.loads(reply.choices[0].message.content)


def test_response_format_json_schema_closes_objects_that_do_not_say(client):
    # additionalProperties is left out, as most clients send it; the library's rule applies.
    open_city = copy.deepcopy(CITY)
    del open_city["additionalProperties"]
    for seed in range(3):
        jsonschema.validate(structured_answer(client, open_city, temperature=1.0, seed=seed), CITY)


def test_response_format_with_a_satisfiable_all_of_is_answered(client):
    # pydantic's way of extending a model: its definition and the new keys, one object together.
    named = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}},
        "required": ["name"],
    }
    zoned = {"properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
    schema = {"$defs": {"Named": named}, "allOf": [{"$ref": "#/$defs/Named"}, zoned]}
    answer = structured_answer(client, schema, temperature=0)
    jsonschema.validate(answer, schema)
    assert isinstance(answer, dict) and set(answer) == {"name", "zone"}


def test_chat_openai_bind_tools_against_the_server(base_url):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model="tiny", base_url=f"{base_url}/v1", api_key="unused", max_tokens=120, max_retries=0
    )
    message = chat.bind_tools([WEATHER, TIME], tool_choice="any", parallel_tool_calls=False).invoke(
        "Weather in Paris?"
    )
    assert message.tool_calls and all(c["id"] for c in message.tool_calls)
    for call in message.tool_calls:
        jsonschema.validate(call["args"], parameters(call["name"]))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "'nope', which is not among the tools",
        ),
        ({"tool_choice": "auto"}, "tool_choice needs tools"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frobnicate"}},
                }
            },
            "frobnicate",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot be combined",
        ),
        ({"tools": [{"type": "function", "function": {"name": "x", "bogus": 1}}]}, "tools.0.function.bogus"),
    ],
)
def test_bad_tool_requests_get_a_400_that_names_the_problem(base_url, extra, message):
    body = {"model": "tiny", "messages": ASK, "max_tokens": 8, **extra}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def streamed_message(events: list[dict]) -> tuple[str, list[tuple[str, dict]], str | None]:
    """(content, calls, finish_reason) of a chat stream's chunks, the way a client adds them up."""
    content, calls, finish = "", {}, None
    for event in events:
        choice = event["choices"][0]
        content += choice["delta"].get("content") or ""
        for call in choice["delta"].get("tool_calls") or []:
            entry = calls.setdefault(call["index"], [None, ""])
            entry[0] = call["function"].get("name") or entry[0]
            entry[1] += call["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return content, [(name, json.loads(arguments)) for name, arguments in calls.values()], finish


def test_a_tool_call_cut_by_max_tokens_streams_what_the_whole_answer_says(base_url):
    from server_helpers import sse_events

    seen = set()
    for max_tokens in range(2, 43, 5):  # cut in the tag, the name, the arguments, a second call
        body = {"model": "tiny", "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required"}
        body.update(max_tokens=max_tokens, seed=0, temperature=1.0)
        whole = httpx.post(f"{base_url}/v1/chat/completions", json=body).json()["choices"][0]
        message = whole["message"]
        calls = [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls") or []
        ]
        streamed = httpx.post(f"{base_url}/v1/chat/completions", json={**body, "stream": True})
        assert streamed_message(sse_events(streamed.text)) == (
            message["content"] or "",
            calls,
            whole["finish_reason"],
        )
        assert "<tool" not in (message["content"] or ""), max_tokens
        seen.add((whole["finish_reason"], bool(calls)))
    assert {("length", False), ("length", True)} <= seen  # cut in the first call, and after it
