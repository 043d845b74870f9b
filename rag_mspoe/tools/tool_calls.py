"""Tool calling on the one engine: the model sees the tools through its chat template, writes
calls whose arguments always validate against each tool's schema, and gets them back parsed.

    answer = generate_with_tools(engine, "Weather in Paris?", [weather_tool], tool_choice="required")
    answer.tool_calls[0].name, answer.tool_calls[0].arguments      # 'get_weather', {'city': 'Paris'}

tool_choice, as in the OpenAI API: "auto" (the model answers in text or calls tools), "required"
(at least one call), a tool's name or {"type": "function", "function": {"name": ...}} (that tool),
"none" (text only; the tools are still shown, as the conversation may refer to them).

`stream_with_tools` streams the same answer: text as it is written and each call, with its id,
name and arguments, once the model has written it whole (`tool_stream.ToolCallDelta`). An answer
the token limit cuts off (finish reason "length") holds the calls it finished and no part of the
one it was writing, streamed or not.

    for event in stream_with_tools(engine, "Weather in Paris?", [weather_tool]):
        ...                                    # str, or ToolCallDelta(index, id, name, arguments)

Both are `plan_tools` (check the tools, settle the engine's settings), a generation, and
`ToolPlan.answer`; a caller that runs generations itself (the server's batcher) uses those parts.

Calls are written in the model's own format (`tool_format.format_for`: Qwen/Hermes `<tool_call>`
tags, Llama 3.1 JSON, Mistral `[TOOL_CALLS]`), held to the tools' schemas by the grammar
(`tool_grammar`), and read back with transformers' response parsing where the tokenizer declares
a response template, else by `tool_format.parse_calls` (`tool_parsing`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rag_mspoe.engine import AsyncTextStream, Engine, GenerationResult, TextStream
from rag_mspoe.prompts.chat_template import Prompt
from rag_mspoe.tools import tool_format, tool_grammar, tool_parsing
from rag_mspoe.tools.tool_stream import CallSplitter, ToolCallDelta, new_call_id

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


@dataclass(frozen=True)
class ToolPlan:
    """How one conversation's answer may call tools: the engine settings that show the tools (and,
    unless tool_choice is "none", hold the calls to the grammar of their schemas), and how the
    generated text becomes a `ToolAnswer`. Plans for the same tools and settings have equal
    `settings`, so their prompts can run as one batch (`Engine.generate_batch`, `run_streams`)."""

    engine: Engine
    prompt: Prompt
    tools: list[dict[str, Any]]  # checked
    settings: dict[str, Any]  # the engine's generate() arguments

    def splitter(self) -> CallSplitter | None:
        """What tells a stream's text from its calls; None when the model may not call tools."""
        if "grammar" not in self.settings:
            return None
        return CallSplitter(tool_names=[tool["function"]["name"] for tool in self.tools])

    def answer(self, result: GenerationResult, splitter: CallSplitter | None = None) -> ToolAnswer:
        """The generated result as text and calls; a streamed answer's calls keep the ids its
        splitter gave them."""
        if "grammar" not in self.settings:
            return ToolAnswer(result.text, (), result)
        content, calls = tool_parsing.parse_answer(
            self.engine.tokenizer, result.text, self.prompt, self.tools, cut=result.finish_reason == "length"
        )
        ids = list(splitter.ids if splitter is not None else ())
        named = ids[: len(calls)] + [new_call_id() for _ in calls[len(ids) :]]
        return ToolAnswer(
            content,
            tuple(ToolCall(call_id, name, args) for call_id, (name, args) in zip(named, calls, strict=True)),
            result,
        )


def plan_tools(
    engine: Engine,
    prompt: Prompt,
    tools: Sequence[Mapping[str, Any]],
    *,
    tool_choice: ToolChoice = "auto",
    parallel_tool_calls: bool = True,
    **settings: Any,
) -> ToolPlan:
    """Check the tools and the choice, and settle the engine's settings for an answer that may
    call them (settings are the engine's generate() arguments)."""
    checked = check_tools(tools)
    mode, callable_tools = resolve_choice(tool_choice, checked)
    taken = sorted({"grammar", "tools", "prefix", "raw"} & set(settings))
    if taken:
        raise TypeError(f"Tool calling sets {taken} itself; leave them out.")
    if mode == "none":
        return ToolPlan(engine, prompt, checked, {**settings, "tools": checked})
    if settings.get("logprobs") is not None:
        raise ValueError(
            "logprobs cannot be combined with tools the model may call (a call's tokens are not the "
            "answer's text); drop logprobs, or pass tool_choice='none'."
        )
    # A named tool is called once, as in the OpenAI API; otherwise several calls may follow each other.
    parallel = parallel_tool_calls and tool_choice in ("auto", "required")
    fmt = tool_format.format_for(engine.tokenizer)
    grammar = tool_grammar.call_grammar(engine.tokenizer, fmt, callable_tools, mode, parallel)  # type: ignore[arg-type]
    return ToolPlan(engine, prompt, checked, {**settings, "tools": checked, "grammar": grammar})


def generate_with_tools(
    engine: Engine,
    prompt: Prompt,
    tools: Sequence[Mapping[str, Any]],
    *,
    tool_choice: ToolChoice = "auto",
    parallel_tool_calls: bool = True,
    cancel: threading.Event | None = None,
    **settings: Any,
) -> ToolAnswer:
    """Answer a conversation that offers tools; settings are the engine's generate() arguments."""
    plan = plan_tools(
        engine, prompt, tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls, **settings
    )
    return plan.answer(engine.generate(prompt, cancel=cancel, **plan.settings))


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
    plan = plan_tools(
        engine, prompt, tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls, **settings
    )
    return ToolStream(engine.stream(prompt, **plan.settings), plan)


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
    plan = plan_tools(
        engine, prompt, tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls, **settings
    )
    return AsyncToolStream(engine.astream(prompt, **plan.settings), plan)


class ToolStream:
    """Text pieces (str) and `ToolCallDelta`s of one answer; `.answer` is set once it ends.

    Leaving the loop early (or `close()`) stops the generation at the next token.
    """

    def __init__(self, stream: TextStream, plan: ToolPlan) -> None:
        self.answer: ToolAnswer | None = None
        self._stream, self._plan, self._splitter = stream, plan, plan.splitter()

    def __iter__(self) -> Iterator[str | ToolCallDelta]:
        try:
            for piece in self._stream:
                yield from self._splitter.feed(piece) if self._splitter else [piece]
        finally:
            self._stream.close()
        assert self._stream.result is not None
        if self._splitter is not None:
            yield from self._splitter.finish(cut=self._stream.result.finish_reason == "length")
        self.answer = self._plan.answer(self._stream.result, self._splitter)

    def close(self) -> None:
        self._stream.close()


class AsyncToolStream:
    """The async form of `ToolStream`: `async for event in stream`, then `.answer`."""

    def __init__(self, stream: AsyncTextStream, plan: ToolPlan) -> None:
        self.answer: ToolAnswer | None = None
        self._stream, self._plan, self._splitter = stream, plan, plan.splitter()

    async def __aiter__(self) -> AsyncIterator[str | ToolCallDelta]:
        try:
            async for piece in self._stream:
                for event in self._splitter.feed(piece) if self._splitter else [piece]:
                    yield event
        finally:
            self._stream.close()
        assert self._stream.result is not None
        cut = self._stream.result.finish_reason == "length"
        for event in self._splitter.finish(cut) if self._splitter else []:
            yield event
        self.answer = self._plan.answer(self._stream.result, self._splitter)

    def close(self) -> None:
        self._stream.close()
