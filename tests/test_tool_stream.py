"""Streamed tool calls (text and call chunks as they are generated) and how calls are parsed back:
transformers' response parsing where the tokenizer declares a response template, else our own."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
from test_tool_calls import TOOLS, tiny  # noqa: F401  # the tiny engine fixture

from rag_mspoe.tools.text_markers import unfinished_tail
from rag_mspoe.tools.tool_calls import astream_with_tools, generate_with_tools, stream_with_tools
from rag_mspoe.tools.tool_format import CALL_CLOSE, CALL_OPEN, call_text, parse_calls
from rag_mspoe.tools.tool_parsing import parse_answer
from rag_mspoe.tools.tool_stream import CallSplitter, ToolCallDelta

ADD_1_2 = call_text("add", {"a": 1, "b": 2})
LOOKUP = call_text("lookup", {"query": 'say "hi" {[}', "k": 3})
TEXTS = [
    "Just text, no calls.",
    f"{ADD_1_2}\n{LOOKUP}",
    f"  Let me add.\n{ADD_1_2}\nand more < text <t <to\n",
    f"Let me add.\n{ADD_1_2}\n<tool_call>oops</tool_call>",
    '<tool_call>\n{"arguments": {"a": 1}, "name": "add"}\n</tool_call>',  # keys in another order
    'Cut by the token limit: <tool_call>\n{"na',
    "",
]
# The response template of the Qwen2.5/Hermes call format, for the SmolLM2 chat template.
HERMES_RESPONSE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"\s*<\|im_end\|>", "content": "text"},
    },
}


def events_of(pieces: list[str], cut: bool = False) -> tuple[str, list[ToolCallDelta]]:
    splitter = CallSplitter()
    events = [event for piece in pieces for event in splitter.feed(piece)] + splitter.finish(cut)
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    for delta in deltas:
        assert delta.id == splitter.ids[delta.index]
    return "".join(e for e in events if isinstance(e, str)), deltas


def split(pieces: list[str], cut: bool = False) -> tuple[str, list[tuple[str, dict]]]:
    """(the streamed text, the streamed calls assembled) of an answer's pieces."""
    text, deltas = events_of(pieces, cut)
    assert [delta.index for delta in deltas] == list(range(len(deltas)))  # each call once, whole
    return text, [(delta.name, json.loads(delta.arguments)) for delta in deltas]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_and_calls_equal_the_parsed_answer_however_it_is_cut(text):
    content, calls = parse_calls(text)
    for size in (1, 3, 7, len(text) or 1):
        streamed, assembled = split([text[i : i + size] for i in range(0, len(text), size)])
        assert (streamed, assembled) == (content, calls)


BARE_ADD = '{"name": "add", "arguments": {"a": 1, "b": 2}}'


@pytest.mark.parametrize(
    "text",
    [
        f"{ADD_1_2}\n{LOOKUP}\n",
        f"Let me add.\n{ADD_1_2}\nand more < text",
        BARE_ADD,
        f"```json\n{BARE_ADD}\n```",
        f"<think>\nhmm\n</think>\n\n{BARE_ADD}",
        f"[TOOL_CALLS] [{BARE_ADD}]",
    ],
)
def test_an_answer_cut_anywhere_streams_what_its_parse_gives_and_no_call_markup(text):
    for end in range(len(text) + 1):
        answer = text[:end]
        content, calls = parse_calls(answer, cut=True)
        assert split(list(answer), cut=True) == (content, calls), answer
        assert split([answer], cut=True) == (content, calls), answer
        assert CALL_OPEN not in content and CALL_CLOSE not in content, answer
        half_tag = unfinished_tail(answer, (CALL_OPEN,))
        assert not (half_tag and content.endswith(answer[-half_tag:])), answer  # a tag cut in half
        assert '{"name"' not in content, answer  # nor a bare call's JSON
        complete = parse_calls(text)[1]
        assert calls == complete[: len(calls)], answer  # only calls finished before the cut


def test_a_cut_call_after_a_whole_one_is_dropped_and_the_whole_one_kept():
    text = f"{ADD_1_2}\n<tool_call>\n" + '{"name": "add", "arguments": {"a":'
    assert split(list(text), cut=True) == ("", [("add", {"a": 1, "b": 2})])
    assert parse_calls(text, cut=True) == ("", [("add", {"a": 1, "b": 2})])
    # Not cut by the token limit (a stop string ended it): the unfinished call stays text, as before.
    assert parse_calls(text)[0].startswith("<tool_call>") and split(list(text))[0].startswith("<tool_call>")


def test_a_call_comes_out_whole_once_it_is_written():
    splitter = CallSplitter()
    assert [e for piece in LOOKUP[:-1] for e in splitter.feed(piece)] == []  # nothing until it closes
    (delta,) = splitter.feed(LOOKUP[-1])
    assert delta == ToolCallDelta(0, splitter.ids[0], "lookup", '{"query": "say \\"hi\\" {[}", "k": 3}')
    assert splitter.finish() == []


@pytest.mark.parametrize("seed", range(3))
def test_the_stream_gives_the_answer_generate_gives(tiny, seed):  # noqa: F811
    settings = dict(tool_choice="required", max_new_tokens=200, temperature=1.0, seed=seed)
    stream = stream_with_tools(tiny, "Help.", TOOLS, **settings)
    events = list(stream)
    answer = generate_with_tools(tiny, "Help.", TOOLS, **settings)
    assert stream.answer is not None and stream.answer.result == answer.result
    assert [(c.name, c.arguments) for c in stream.answer.tool_calls] == [
        (c.name, c.arguments) for c in answer.tool_calls
    ]
    calls: dict[int, list[str]] = {}
    for event in events:
        assert isinstance(event, ToolCallDelta)
        calls.setdefault(event.index, [event.id, event.name, ""])[2] += event.arguments
    assert [(i, n, json.loads(a)) for i, n, a in calls.values()] == [
        (c.id, c.name, c.arguments) for c in stream.answer.tool_calls
    ]
    assert stream.answer.finish_reason == "tool_calls"


def test_text_answers_and_tool_choice_none_stream_as_text(tiny):  # noqa: F811
    for choice in ("auto", "none"):
        stream = stream_with_tools(tiny, "Help.", TOOLS, tool_choice=choice, max_new_tokens=8)
        text = "".join(event for event in stream if isinstance(event, str))
        answer = generate_with_tools(tiny, "Help.", TOOLS, tool_choice=choice, max_new_tokens=8)
        assert stream.answer is not None and stream.answer.tool_calls == answer.tool_calls == ()
        assert text and text == stream.answer.content == answer.content


def test_the_async_stream_matches(tiny):  # noqa: F811
    settings = dict(tool_choice="required", max_new_tokens=200, temperature=1.0, seed=1)

    async def collect() -> tuple[list, object]:
        stream = astream_with_tools(tiny, "Help.", TOOLS, **settings)
        return [event async for event in stream], stream.answer

    events, answer = asyncio.run(collect())
    sync = stream_with_tools(tiny, "Help.", TOOLS, **settings)
    sync_events = list(sync)
    assert [(e.index, e.name, e.arguments) for e in events] == [
        (e.index, e.name, e.arguments) for e in sync_events
    ]
    assert answer is not None and [c.id for c in answer.tool_calls] == [  # type: ignore[attr-defined]
        e.id for e in events if e.id
    ]


def test_leaving_the_stream_early_frees_the_model(tiny):  # noqa: F811
    stream = stream_with_tools(tiny, "Help.", TOOLS, tool_choice="required", max_new_tokens=200)
    next(iter(stream))
    stream.close()
    assert generate_with_tools(tiny, "Help.", TOOLS, tool_choice="required", max_new_tokens=60, timeout=30)


@pytest.fixture(scope="module")
def declaring(tiny):  # noqa: F811
    """The tiny engine's tokenizer with a response template attached, as a tokenizer_config.json
    declaring one loads it."""
    tokenizer = copy.copy(tiny.tokenizer)
    tokenizer.response_template = HERMES_RESPONSE
    return tokenizer


@pytest.mark.parametrize(
    "text",
    [
        f"{ADD_1_2}\n{LOOKUP}",
        f"Let me look.\n{LOOKUP}",
        call_text("lookup", {"query": "7", "k": 5}),
        "No call here.",
    ],
)
def test_response_template_and_our_parser_read_the_same_calls(tiny, declaring, text):  # noqa: F811
    ours = parse_answer(tiny.tokenizer, text, "Help.", TOOLS)
    theirs = parse_answer(declaring, text, "Help.", TOOLS)
    assert ours == parse_calls(text) and theirs == ours


def test_the_response_template_is_what_parses_when_declared(tiny, declaring):  # noqa: F811
    # A template that reads calls from other tags proves which parser ran.
    tokenizer = copy.copy(declaring)
    other = copy.deepcopy(HERMES_RESPONSE)
    other["fields"]["tool_calls"].update(open_pattern=r"\s*<call>", close="</call>")
    tokenizer.response_template = other
    text = '<call>{"name": "add", "arguments": {"a": 1, "b": 2}}</call>'
    assert parse_answer(tokenizer, text, "Help.", TOOLS) == ("", [("add", {"a": 1, "b": 2})])
    assert parse_answer(tiny.tokenizer, text, "Help.", TOOLS) == (text, [])


def test_generate_and_stream_with_a_declaring_tokenizer_give_the_same_calls(tiny, declaring):  # noqa: F811
    from rag_mspoe.engine import Engine

    engine = Engine(tiny.model, declaring, name="tiny-declaring")
    settings = dict(tool_choice="required", max_new_tokens=200, temperature=1.0, seed=2)
    plain = generate_with_tools(tiny, "Help.", TOOLS, **settings)
    declared = generate_with_tools(engine, "Help.", TOOLS, **settings)
    stream = stream_with_tools(engine, "Help.", TOOLS, **settings)
    list(stream)
    assert plain.result.text == declared.result.text
    expected = [(c.name, c.arguments) for c in plain.tool_calls]
    assert expected and [(c.name, c.arguments) for c in declared.tool_calls] == expected
    assert stream.answer is not None and [(c.name, c.arguments) for c in stream.answer.tool_calls] == expected


def streamed_answer(events: list) -> tuple[str, list[tuple[str, dict]]]:
    """(the text, the calls) of a tool stream's events; every call's arguments parse."""
    calls = [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCallDelta)]
    return "".join(event for event in events if isinstance(event, str)), calls


@pytest.mark.parametrize(
    "settings",
    [
        {"tool_choice": "required", "seed": 0},  # a whole call, then a second one cut from 38 on
        {"tool_choice": "required", "parallel_tool_calls": False, "seed": 1},
        {"tool_choice": "auto", "seed": 0},
    ],
)
def test_a_stream_cut_by_max_tokens_gives_what_generate_gives(tiny, settings):  # noqa: F811
    most_calls = 0
    for max_new_tokens in range(2, 50, 4):  # cut in the tag, the name, the arguments, the next call
        kwargs = {**settings, "max_new_tokens": max_new_tokens, "temperature": 1.0}
        answer = generate_with_tools(tiny, "Help.", TOOLS, **kwargs)
        stream = stream_with_tools(tiny, "Help.", TOOLS, **kwargs)
        streamed = streamed_answer(list(stream))
        assert stream.answer is not None and stream.answer.result == answer.result
        assert streamed == (answer.content, [(c.name, c.arguments) for c in answer.tool_calls])
        assert stream.answer.content == answer.content and stream.answer.finish_reason == answer.finish_reason
        assert "<tool" not in answer.content and '{"name"' not in answer.content, max_new_tokens
        if answer.result.finish_reason == "length":
            assert answer.finish_reason == "length"
        most_calls = max(most_calls, len(answer.tool_calls))
    assert most_calls >= (settings["tool_choice"] == "required")  # the range reaches whole calls
