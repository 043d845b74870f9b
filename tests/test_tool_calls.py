"""Tool calling on the engine: rendering tools and tool turns, constrained calls, parsing them back."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest
from tiny_models import tiny_model

from rag_mspoe.engine import Engine
from rag_mspoe.prompts.chat_template import render
from rag_mspoe.tools.tool_calls import generate_with_tools
from rag_mspoe.tools.tool_format import CALL_OPEN, parse_calls

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Find a document.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 20}, "k": {"enum": [1, 3, 5]}},
            "required": ["query", "k"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [ADD, LOOKUP]
HISTORY = [
    {"role": "user", "content": "What is 2 + 3?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
]


@pytest.fixture(scope="module")
def tiny(embedded):
    tokenizer = embedded[1]
    model = tiny_model(
        "llama", vocab_size=len(tokenizer), max_position_embeddings=1024, initializer_range=0.3
    )
    return Engine(model, tokenizer, name="tiny-llama")


def schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


@pytest.mark.parametrize("seed", range(4))
def test_required_calls_always_validate(tiny, seed):
    answer = generate_with_tools(
        tiny, "Help.", TOOLS, tool_choice="required", max_new_tokens=300, temperature=1.0, seed=seed
    )
    assert answer.tool_calls and answer.finish_reason == "tool_calls"
    for call in answer.tool_calls:
        jsonschema.validate(call.arguments, schema_of(call.name))
        assert call.id.startswith("call_")
        assert json.loads(call.openai()["function"]["arguments"]) == call.arguments
    assert len({call.id for call in answer.tool_calls}) == len(answer.tool_calls)


def test_named_tool_is_called_once(tiny):
    for seed in range(3):
        answer = generate_with_tools(
            tiny,
            "Help.",
            TOOLS,
            tool_choice={"type": "function", "function": {"name": "lookup"}},
            max_new_tokens=200,
            temperature=1.0,
            seed=seed,
        )
        assert [call.name for call in answer.tool_calls] == ["lookup"]
        jsonschema.validate(answer.tool_calls[0].arguments, schema_of("lookup"))


def test_auto_and_none_answer_in_text_when_the_model_does_not_call(tiny):
    auto = generate_with_tools(tiny, "Help.", TOOLS, tool_choice="auto", max_new_tokens=8)
    assert not auto.tool_calls and auto.content and not auto.content.startswith(CALL_OPEN[:3])
    none = generate_with_tools(tiny, "Help.", TOOLS, tool_choice="none", max_new_tokens=8)
    assert (
        none.tool_calls == () and none.content == tiny.generate("Help.", tools=TOOLS, max_new_tokens=8).text
    )


def test_history_with_calls_and_results_is_rendered_as_text_for_a_template_without_tools(tiny):
    text = tiny.tokenizer.decode(render(tiny.tokenizer, HISTORY, tools=TOOLS))
    assert '"name": "lookup"' in text  # the tool list, in the system turn
    assert f'{CALL_OPEN}\n{{"name": "add", "arguments": {{"a": 2, "b": 3}}}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response>" in text


def test_a_template_that_knows_tools_gets_them_natively(tiny):
    tokenizer = copy.copy(tiny.tokenizer)
    tokenizer.chat_template = (
        "{% for t in tools or [] %}TOOL {{ t.function.name + '\\n' }}{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
        "{{ c.function.arguments | tojson }}{% endfor %}"
        "{{ '\\n' }}{% endfor %}"
    )
    text = tokenizer.decode(render(tokenizer, HISTORY, tools=TOOLS))
    assert (
        text == 'TOOL add\nTOOL lookup\nuser: What is 2 + 3?\nassistant: CALL add {"a": 2, "b": 3}\ntool: 5\n'
    )


def test_parse_calls_keeps_text_and_broken_calls():
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    text = f"Let me add.\n{call}\n<tool_call>oops</tool_call>"
    content, calls = parse_calls(text)
    assert calls == [("add", {"a": 1, "b": 2})]
    assert content == "Let me add.\n\n<tool_call>oops</tool_call>"


def test_bad_tools_and_choices_are_named(tiny):
    with pytest.raises(ValueError, match="not among the tools \\(add, lookup\\)"):
        generate_with_tools(tiny, "?", TOOLS, tool_choice="multiply")
    with pytest.raises(ValueError, match="Two tools are named 'add'"):
        generate_with_tools(tiny, "?", [ADD, ADD])
    with pytest.raises(TypeError, match="tools\\[0\\] must be"):
        generate_with_tools(tiny, "?", [{"name": "add"}])
    with pytest.raises(TypeError, match="sets \\['grammar'\\] itself"):
        generate_with_tools(tiny, "?", TOOLS, grammar=None)
