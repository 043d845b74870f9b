"""LangChain tool calling with real LangChain objects: bind_tools, tool calls with ids, ToolMessage
history, streaming, and every with_structured_output method, on a tiny random model (whose calls
are valid only because the grammar makes them so)."""

from __future__ import annotations

import asyncio
from typing import Annotated

import jsonschema
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, ConfigDict, Field
from tiny_models import tiny_model

from rag_mspoe.connectors.langchain import ChatRagMsPoE
from rag_mspoe.engine import Engine


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@tool
def shout(text: Annotated[str, Field(max_length=12)]) -> str:
    """Say something loudly."""
    return text.upper()


class City(BaseModel):
    """A city."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=10**8)


@pytest.fixture(scope="module")
def chat(embedded):
    tokenizer = embedded[1]
    model = tiny_model(
        "llama", vocab_size=len(tokenizer), max_position_embeddings=1024, initializer_range=0.3
    )
    return ChatRagMsPoE(engine=Engine(model, tokenizer, name="tiny-llama"), max_tokens=120, temperature=1.0)


def check_calls(message: AIMessage, names: set[str]) -> None:
    schemas = {t.name: convert_to_openai_tool(t)["function"]["parameters"] for t in (multiply, shout)}
    assert message.tool_calls
    for call in message.tool_calls:
        assert call["name"] in names and call["id"] and call["type"] == "tool_call"
        jsonschema.validate(call["args"], schemas[call["name"]])


def test_bind_tools_gives_tool_calls_with_ids(chat):
    for seed in range(3):
        message = chat.bind_tools([multiply, shout], tool_choice="any").invoke("Compute 6 x 7.", seed=seed)
        check_calls(message, {"multiply", "shout"})
        assert message.response_metadata["finish_reason"] == "tool_calls"
    named = chat.bind_tools([multiply, shout], tool_choice="shout").invoke("Shout hi.", seed=1)
    check_calls(named, {"shout"})
    assert len(named.tool_calls) == 1


def test_tool_results_go_back_in_and_the_tool_runs(chat):
    bound = chat.bind_tools([multiply], tool_choice="multiply")
    first = bound.invoke("Compute 6 x 7.", seed=2)
    call = first.tool_calls[0]
    result = multiply.invoke(call)  # LangChain runs the tool from the call, id included
    assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
    answer = chat.bind_tools([multiply], tool_choice="none").invoke(
        [HumanMessage("Compute 6 x 7."), first, result], max_tokens=5, temperature=0.0
    )
    assert isinstance(answer.content, str) and not answer.tool_calls


@pytest.mark.parametrize("settings", [{"seed": 4}, {"temperature": 0.0}])
def test_streamed_call_chunks_add_up_to_the_invoked_calls(chat, settings):
    bound = chat.bind_tools([multiply, shout], tool_choice="any")
    chunks = list(bound.stream("Compute 6 x 7.", **settings))
    full = chunks[0]
    for chunk in chunks[1:]:
        full += chunk
    invoked = bound.invoke("Compute 6 x 7.", **settings)
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [
        (c["name"], c["args"]) for c in invoked.tool_calls
    ]
    check_calls(full, {"multiply", "shout"})
    assert full.usage_metadata["output_tokens"] > 0
    assert full.response_metadata["finish_reason"] == "tool_calls"
    pieces = [c for c in chunks if c.tool_call_chunks]
    assert len(pieces) == len(full.tool_calls)  # each call whole, once written (none cut off)
    assert all(c.tool_call_chunks[0]["name"] and c.tool_call_chunks[0]["id"] for c in pieces)


def test_async_stream_adds_up_to_the_same_calls(chat):
    bound = chat.bind_tools([multiply, shout], tool_choice="any")

    async def collect() -> AIMessageChunk:
        full = None
        async for chunk in bound.astream("Compute 6 x 7.", seed=4):
            full = chunk if full is None else full + chunk
        return full

    full = asyncio.run(collect())
    invoked = bound.invoke("Compute 6 x 7.", seed=4)
    assert full.response_metadata["finish_reason"] == "tool_calls"  # no call cut by the token limit
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [
        (c["name"], c["args"]) for c in invoked.tool_calls
    ]


def test_smollm2_streams_the_call_it_invokes(embedded):
    chat = ChatRagMsPoE(engine=Engine(*embedded), max_tokens=60)
    bound = chat.bind_tools([multiply], tool_choice="any", parallel_tool_calls=False)
    full = None
    for chunk in bound.stream("What is 6 times 7? Use the tool."):
        full = chunk if full is None else full + chunk
    invoked = bound.invoke("What is 6 times 7? Use the tool.")
    assert full.tool_calls and [(c["name"], c["args"]) for c in full.tool_calls] == [
        (c["name"], c["args"]) for c in invoked.tool_calls
    ]
    check_calls(full, {"multiply"})
    assert full.response_metadata["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_structured_output_every_method(chat, method):
    city = chat.with_structured_output(City, method=method).invoke("Name a city.", seed=3)
    assert isinstance(city, City)
    raw = chat.with_structured_output(City.model_json_schema(), method=method, include_raw=True).invoke(
        "Name a city.", seed=3
    )
    assert isinstance(raw["raw"], AIMessage) and raw["parsing_error"] is None
    City.model_validate(raw["parsed"])


def test_stop_reaches_the_constrained_call(chat):
    bound = chat.bind_tools([multiply], tool_choice="multiply")
    invoked = bound.invoke("Compute 6 x 7.", seed=1, stop=['"b"'])
    streamed = list(bound.stream("Compute 6 x 7.", seed=1, stop=['"b"']))
    # The call stops where its second argument would start: no call, the text up to there.
    assert not invoked.tool_calls and invoked.content.endswith(",")
    assert '"arguments": {"a": ' in invoked.content
    assert invoked.response_metadata["finish_reason"] == "stop"
    assert streamed[-1].response_metadata["finish_reason"] == "stop"
