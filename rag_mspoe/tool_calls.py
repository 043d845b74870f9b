"""Tool calling on the one engine: the model sees the tools through its chat template, writes
calls whose arguments always validate against each tool's schema, and gets them back parsed.

    answer = generate_with_tools(engine, "Weather in Paris?", [weather_tool], tool_choice="required")
    answer.tool_calls[0].name, answer.tool_calls[0].arguments      # 'get_weather', {'city': 'Paris'}

tool_choice, as in the OpenAI API: "auto" (the model answers in text or calls tools), "required"
(at least one call), a tool's name or {"type": "function", "function": {"name": ...}} (that tool),
"none" (text only; the tools are still shown, as the conversation may refer to them).

`stream_with_tools` streams the same answer: text as it is written and, once the model writes a
call, its id and name, then its arguments' JSON in fragments (`tool_stream.ToolCallDelta`).

    for event in stream_with_tools(engine, "Weather in Paris?", [weather_tool]):
        ...                                    # str, or ToolCallDelta(index, id, name, arguments)

Calls are written in the model's own format (`tool_format.format_for`: Qwen/Hermes `<tool_call>`
tags, Llama 3.1 JSON, Mistral `[TOOL_CALLS]`), held to the tools' schemas by the grammar
(`tool_grammar`), and read back with transformers' response parsing where the tokenizer declares
a response template, else by `tool_format.parse_calls` (`tool_parsing`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rag_mspoe import tool_format, tool_grammar, tool_parsing
from rag_mspoe.chat_template import Prompt
from rag_mspoe.engine import AsyncTextStream, Engine, GenerationResult, TextStream
from rag_mspoe.tool_stream import CallSplitter, ToolCallDelta, new_call_id

ToolChoice = str | Mapping[str, Any]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The OpenAI wire shape (arguments as JSON text)."""
        arguments = json.dumps(self.arguments, ensure_ascii=False)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


@dataclass(frozen=True)
class ToolAnswer:
    """The text the model wrote outside calls, its calls, and the generation's counts."""

    content: str
    tool_calls: tuple[ToolCall, ...]
    result: GenerationResult

    @property
    def finish_reason(self) -> str:
        """ "tool_calls" when the model called tools, else why generation ended ("stop", "length")."""
        return (
            "tool_calls"
            if self.tool_calls and self.result.finish_reason == "stop"
            else self.result.finish_reason
        )


def check_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-style tool definitions, checked: {"type": "function", "function": {"name", ...}}."""
    if isinstance(tools, Mapping) or not isinstance(tools, Sequence) or not tools:
        raise TypeError("tools is a non-empty list of {'type': 'function', 'function': {...}} dicts.")
    checked, names = [], set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if (
            not isinstance(tool, Mapping)
            or tool.get("type") != "function"
            or not isinstance(function, Mapping)
        ):
            raise TypeError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name', ...}}}}, got {tool!r}."
            )
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function needs a non-empty 'name'.")
        if name in names:
            raise ValueError(f"Two tools are named {name!r}; tool names must be unique.")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise TypeError(f"tools[{i}].function.parameters must be a JSON schema dict, got {parameters!r}.")
        names.add(name)
        checked.append({"type": "function", "function": dict(function)})
    return checked


def resolve_choice(
    tool_choice: ToolChoice, tools: Sequence[Mapping[str, Any]]
) -> tuple[str, list[dict[str, Any]]]:
    """("none" | "auto" | "required", the tools the model may call) for a tool_choice."""
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        if (
            tool_choice.get("type") != "function"
            or not isinstance(function, Mapping)
            or "name" not in function
        ):
            raise ValueError(
                "tool_choice as a dict is {'type': 'function', 'function': {'name': ...}}, "
                f"got {dict(tool_choice)!r}."
            )
        tool_choice = str(function["name"])
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, [dict(t) for t in tools]
    named = [dict(t) for t in tools if t["function"]["name"] == tool_choice]
    if not named:
        available = ", ".join(t["function"]["name"] for t in tools)
        raise ValueError(
            f"tool_choice names {tool_choice!r}, which is not among the tools ({available}); "
            "use 'auto', 'required', 'none' or one of those names."
        )
    return "required", named


def generate_with_tools(
    engine: Engine,
    prompt: Prompt,
    tools: Sequence[Mapping[str, Any]],
    *,
    tool_choice: ToolChoice = "auto",
    parallel_tool_calls: bool = True,
    **settings: Any,
) -> ToolAnswer:
    """Answer a conversation that offers tools; settings are the engine's generate() arguments
    (cancel included)."""
    checked, call = _engine_settings(engine, tools, tool_choice, parallel_tool_calls, settings)
    result = engine.generate(prompt, **call)
    if "grammar" not in call:
        return ToolAnswer(result.text, (), result)
    return _answer(engine, prompt, checked, result, ())


def stream_with_tools(
    engine: Engine,
    prompt: Prompt,
    tools: Sequence[Mapping[str, Any]],
    *,
    tool_choice: ToolChoice = "auto",
    parallel_tool_calls: bool = True,
    **settings: Any,
) -> ToolStream:
    """`generate_with_tools`, streamed: text pieces and `ToolCallDelta`s as they are generated,
    then `.answer`, the answer `generate_with_tools` gives, with the streamed calls' ids."""
    checked, call = _engine_settings(engine, tools, tool_choice, parallel_tool_calls, settings)
    stream = engine.stream(prompt, **call)
    splitter = _splitter(checked) if "grammar" in call else None
    return ToolStream(stream, splitter, lambda result: _finished(engine, prompt, checked, result, splitter))


def astream_with_tools(
    engine: Engine,
    prompt: Prompt,
    tools: Sequence[Mapping[str, Any]],
    *,
    tool_choice: ToolChoice = "auto",
    parallel_tool_calls: bool = True,
    **settings: Any,
) -> AsyncToolStream:
    """`stream_with_tools` for `async for`; must be called inside a running event loop."""
    checked, call = _engine_settings(engine, tools, tool_choice, parallel_tool_calls, settings)
    stream = engine.astream(prompt, **call)
    splitter = _splitter(checked) if "grammar" in call else None
    return AsyncToolStream(
        stream, splitter, lambda result: _finished(engine, prompt, checked, result, splitter)
    )


class ToolStream:
    """Text pieces (str) and `ToolCallDelta`s of one answer; `.answer` is set once it ends.

    Leaving the loop early (or `close()`) stops the generation at the next token.
    """

    def __init__(self, stream: TextStream, splitter: CallSplitter | None, finish: _Finish) -> None:
        self.answer: ToolAnswer | None = None
        self._stream, self._splitter, self._finish = stream, splitter, finish

    def __iter__(self) -> Iterator[str | ToolCallDelta]:
        try:
            for piece in self._stream:
                yield from self._splitter.feed(piece) if self._splitter else [piece]
        finally:
            self._stream.close()
        if self._splitter is not None:
            yield from self._splitter.finish()
        assert self._stream.result is not None
        self.answer = self._finish(self._stream.result)

    def close(self) -> None:
        self._stream.close()


class AsyncToolStream:
    """The async form of `ToolStream`: `async for event in stream`, then `.answer`."""

    def __init__(self, stream: AsyncTextStream, splitter: CallSplitter | None, finish: _Finish) -> None:
        self.answer: ToolAnswer | None = None
        self._stream, self._splitter, self._finish = stream, splitter, finish

    async def __aiter__(self) -> AsyncIterator[str | ToolCallDelta]:
        try:
            async for piece in self._stream:
                for event in self._splitter.feed(piece) if self._splitter else [piece]:
                    yield event
        finally:
            self._stream.close()
        for event in self._splitter.finish() if self._splitter else []:
            yield event
        assert self._stream.result is not None
        self.answer = self._finish(self._stream.result)

    def close(self) -> None:
        self._stream.close()


_Finish = Callable[[GenerationResult], ToolAnswer]


def _splitter(tools: Sequence[Mapping[str, Any]]) -> CallSplitter:
    return CallSplitter(tool_names=[tool["function"]["name"] for tool in tools])


def _engine_settings(
    engine: Engine,
    tools: Sequence[Mapping[str, Any]],
    tool_choice: ToolChoice,
    parallel_tool_calls: bool,
    settings: dict[str, Any],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the checked tools, the engine's settings: the tools shown, and the grammar of the calls
    the model may write, in its own format, unless tool_choice is "none")."""
    checked = check_tools(tools)
    mode, callable_tools = resolve_choice(tool_choice, checked)
    taken = sorted({"grammar", "tools", "prefix", "raw"} & set(settings))
    if taken:
        raise TypeError(f"Tool calling sets {taken} itself; leave them out.")
    if mode == "none":
        return checked, {**settings, "tools": checked}
    if settings.get("logprobs") is not None:
        raise ValueError(
            "logprobs cannot be combined with tools the model may call (a call's tokens are not the "
            "answer's text); drop logprobs, or pass tool_choice='none'."
        )
    # A named tool is called once, as in the OpenAI API; otherwise several calls may follow each other.
    parallel = parallel_tool_calls and tool_choice in ("auto", "required")
    fmt = tool_format.format_for(engine.tokenizer)
    grammar = tool_grammar.call_grammar(engine.tokenizer, fmt, callable_tools, mode, parallel)  # type: ignore[arg-type]
    return checked, {**settings, "tools": checked, "grammar": grammar}


def _finished(
    engine: Engine,
    prompt: Prompt,
    tools: list[dict[str, Any]],
    result: GenerationResult,
    splitter: CallSplitter | None,
) -> ToolAnswer:
    if splitter is None:
        return ToolAnswer(result.text, (), result)
    return _answer(engine, prompt, tools, result, splitter.ids)


def _answer(
    engine: Engine,
    prompt: Prompt,
    tools: list[dict[str, Any]],
    result: GenerationResult,
    ids: Sequence[str],
) -> ToolAnswer:
    """The answer parsed into text and calls; the calls take `ids` in order (new ones past them)."""
    content, calls = tool_parsing.parse_answer(engine.tokenizer, result.text, prompt, tools)
    named = list(ids)[: len(calls)] + [new_call_id() for _ in calls[len(ids) :]]
    return ToolAnswer(
        content,
        tuple(ToolCall(call_id, name, args) for call_id, (name, args) in zip(named, calls, strict=True)),
        result,
    )
