"""LlamaIndex function calling with real LlamaIndex objects on a tiny random model: the model
cannot reason, so the tests force calls with tool_choice and rely on the grammar for valid
arguments; they prove the plumbing (calls, ids, tool runs, results fed back, structured output).
No `from __future__ import annotations`: FunctionTool reads the tools' annotations at runtime."""

import asyncio
from typing import Any, Literal

import pytest
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel, ConfigDict, Field
from tiny_models import tiny_model

from rag_mspoe.connectors.llamaindex import RagMsPoE, to_chat_messages
from rag_mspoe.engine import Engine
from rag_mspoe.prompts.chat_template import render

AGENT_SEED = 7  # one where the random model's forced turn calls both tools (0 to 6 call one)

RATES = {"EUR": 1.1, "GBP": 1.3, "JPY": 0.007}
PRICES = {"apple": 2, "bread": 3, "tea": 5}


def price_of(item: Literal["apple", "bread", "tea"]) -> int:
    """The price of an item, in its currency's units."""
    return PRICES[item]


def rate_of(currency: Literal["EUR", "GBP", "JPY"]) -> float:
    """How many dollars one unit of a currency buys."""
    return RATES[currency]


class Order(BaseModel):
    model_config = ConfigDict(extra="forbid")

    item: Literal["apple", "bread", "tea"]
    quantity: int = Field(ge=1, le=9)
    notes: list[Literal["gift", "urgent"]] = Field(max_length=2)


@pytest.fixture(scope="module")
def llm(embedded):
    tokenizer = embedded[1]
    model = tiny_model(
        "llama", vocab_size=len(tokenizer), max_position_embeddings=2048, initializer_range=0.3
    )
    return RagMsPoE(engine=Engine(model, tokenizer, name="tiny-llama"), max_tokens=80)


TOOLS = [FunctionTool.from_defaults(price_of), FunctionTool.from_defaults(rate_of)]


def test_predict_and_call_runs_the_forced_tool(llm):
    response = llm.predict_and_call(TOOLS, "How much is tea?", tool_choice="price_of")
    (source,) = response.sources
    assert source.tool_name == "price_of" and not source.is_error
    assert response.response == str(PRICES[source.raw_input["kwargs"]["item"]])


def test_chat_with_tools_gives_selections_with_ids(llm):
    response = llm.chat_with_tools(TOOLS, "Prices?", tool_required=True, allow_parallel_tool_calls=True)
    selections = llm.get_tool_calls_from_response(response)
    assert selections and all(s.tool_id.startswith("call_") for s in selections)
    assert {s.tool_name for s in selections} <= {"price_of", "rate_of"}
    streamed = list(
        llm.stream_chat_with_tools(TOOLS, "Prices?", tool_required=True, allow_parallel_tool_calls=True)
    )
    assert [s.tool_kwargs for s in llm.get_tool_calls_from_response(streamed[-1])] == [
        s.tool_kwargs for s in selections
    ]
    with pytest.raises(ValueError, match="without calling a tool"):
        llm.get_tool_calls_from_response(llm.chat_with_tools(TOOLS, "Hi", tool_choice="none"))


def test_stream_chat_with_tools_lists_each_call_once_it_is_finished(llm):
    # A seed where the random model calls two tools and stops.
    settings = dict(tool_required=True, allow_parallel_tool_calls=True, temperature=1.0, seed=3)
    whole = llm.get_tool_calls_from_response(llm.chat_with_tools(TOOLS, "Prices?", **settings))
    responses = list(llm.stream_chat_with_tools(TOOLS, "Prices?", **settings))
    seen = [
        [s.tool_kwargs for s in llm.get_tool_calls_from_response(r, error_on_no_tool_call=False)]
        for r in responses
    ]
    assert len(whole) == 2 and seen[-1] == [s.tool_kwargs for s in whole]
    assert seen[0] == seen[-1][:1]  # the first alone, once it is written whole, then both
    assert [s.tool_id for s in llm.get_tool_calls_from_response(responses[-1])] == [
        call["id"] for call in responses[-2].message.additional_kwargs["tool_calls"]
    ]

    async def last_of_async() -> Any:
        stream = await llm.astream_chat_with_tools(TOOLS, "Prices?", **settings)
        return [response async for response in stream][-1]

    streamed = llm.get_tool_calls_from_response(asyncio.run(last_of_async()))
    assert [s.tool_kwargs for s in streamed] == [s.tool_kwargs for s in whole]


def test_smollm2_streams_the_call_it_chats(embedded):
    llm = RagMsPoE(engine=Engine(*embedded), max_tokens=60)
    tools = [FunctionTool.from_defaults(price_of)]
    whole = llm.get_tool_calls_from_response(
        llm.chat_with_tools(tools, "How much is tea?", tool_required=True)
    )
    responses = list(llm.stream_chat_with_tools(tools, "How much is tea?", tool_required=True))
    streamed = llm.get_tool_calls_from_response(responses[-1])
    assert whole and [(s.tool_name, s.tool_kwargs) for s in streamed] == [
        (s.tool_name, s.tool_kwargs) for s in whole
    ]


def test_tool_results_are_rendered_back(llm):
    response = llm.chat_with_tools(TOOLS, "Tea?", tool_choice="price_of")
    (selection,) = llm.get_tool_calls_from_response(response)
    result = ChatMessage(
        role=MessageRole.TOOL, content="5", additional_kwargs={"tool_call_id": selection.tool_id}
    )
    history = [ChatMessage(role=MessageRole.USER, content="Tea?"), response.message, result]
    text = llm.engine.tokenizer.decode(render(llm.engine.tokenizer, to_chat_messages(history)))
    assert f'{{"name": "price_of", "arguments": {{"item": "{selection.tool_kwargs["item"]}"}}}}' in text
    assert "<tool_response>\n5\n</tool_response>" in text
    assert isinstance(llm.chat(history, max_tokens=4).message.content, str)


def test_structured_predict_decodes_the_output_class(llm):
    prompt = PromptTemplate("Order {thing}.")
    for seed in range(3):
        order = llm.structured_predict(
            Order, prompt, llm_kwargs={"temperature": 1.0, "seed": seed}, thing="tea"
        )
        assert isinstance(order, Order)
    assert isinstance(asyncio.run(llm.astructured_predict(Order, prompt, thing="bread")), Order)


def test_function_agent_runs_two_tools_and_answers(embedded):
    """A forced first turn (tool_choice "required", parallel calls), then a text answer.

    The model is random: the seed is one where its forced turn calls both tools. What the test
    proves is the agent loop on this LLM: calls parsed into selections, both tools run with valid
    arguments, their results rendered back as tool turns, and the run ending on a text answer.
    """
    tokenizer = embedded[1]
    model = tiny_model(
        "llama", vocab_size=len(tokenizer), max_position_embeddings=2048, initializer_range=0.3
    )
    llm = RagMsPoE(engine=Engine(model, tokenizer), max_tokens=80, temperature=1.0, seed=AGENT_SEED)

    async def run() -> Any:
        agent = FunctionAgent(
            tools=TOOLS, llm=llm, initial_tool_choice="required", allow_parallel_tool_calls=True
        )
        return await agent.run("What does tea cost in euros?", max_iterations=4)

    result = asyncio.run(run())
    assert {call.tool_name for call in result.tool_calls} == {"price_of", "rate_of"}
    assert all(not call.tool_output.is_error for call in result.tool_calls)
    assert not result.response.additional_kwargs.get("tool_calls") and result.response.content


def test_stop_reaches_the_constrained_call(llm):
    response = llm.chat_with_tools(TOOLS, "Tea?", tool_choice="price_of", stop=['"item"'])
    assert not llm.get_tool_calls_from_response(response, error_on_no_tool_call=False)
    assert response.message.content.endswith('"arguments": {') and response.raw["finish_reason"] == "stop"
