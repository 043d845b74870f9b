"""Tool calling on the one engine: the model sees the tools through its chat template, writes
calls whose arguments always validate against each tool's schema, and gets them back parsed.

    answer = generate_with_tools(engine, "Weather in Paris?", [weather_tool], tool_choice="required")
    answer.tool_calls[0].name, answer.tool_calls[0].arguments      # 'get_weather', {'city': 'Paris'}

tool_choice, as in the OpenAI API: "auto" (the model answers in text or calls tools), "required"
(at least one call), a tool's name or {"type": "function", "function": {"name": ...}} (that tool),
"none" (text only; the tools are still shown, as the conversation may refer to them).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rag_mspoe import tool_format
from rag_mspoe.chat_template import Prompt
from rag_mspoe.engine import Engine, GenerationResult

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
    """Answer a conversation that offers tools; settings are the engine's (stop excepted)."""
    checked = check_tools(tools)
    mode, callable_tools = resolve_choice(tool_choice, checked)
    taken = sorted({"grammar", "tools", "prefix", "raw"} & set(settings))
    if taken:
        raise TypeError(f"generate_with_tools sets {taken} itself; leave them out.")
    if mode == "none":
        result = engine.generate(prompt, tools=checked, **settings)
        return ToolAnswer(result.text, (), result)
    # A named tool is called once, as in the OpenAI API; otherwise several calls may follow each other.
    parallel = parallel_tool_calls and tool_choice in ("auto", "required")
    grammar = tool_format.call_grammar(callable_tools, mode, parallel)  # type: ignore[arg-type]
    result = engine.generate(prompt, tools=checked, grammar=grammar, **settings)
    content, calls = tool_format.parse_calls(result.text)
    return ToolAnswer(
        content,
        tuple(ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, args) for name, args in calls),
        result,
    )
