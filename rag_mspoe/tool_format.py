"""How tool calls look as text: one format, written, constrained and parsed in one place.

A call is a JSON object between tags, the format Qwen2.5, Qwen3 and Hermes templates use:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

For chat templates that do not render tools (SmolLM2, for one), `fold_into_text` writes the
tool list into the system turn, earlier calls into the assistant turns and tool results into user
turns, in the same format. `call_grammar` lets the model write only calls whose arguments are
valid for their tool's schema (and, with tool_choice "auto", free text instead).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from rag_mspoe.grammar import JSON_OPTIONS, Grammar, closed_objects

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)


def instructions(tools: Sequence[Mapping[str, Any]]) -> str:
    """The text that shows the tools to a model whose template cannot."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You can call functions to help answer. The functions, as JSON signatures:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call one, answer with a JSON object with the function's name and its arguments, "
        f"between {CALL_OPEN} and {CALL_CLOSE} tags:\n"
        f'{CALL_OPEN}\n{{"name": <function name>, "arguments": <arguments object>}}\n{CALL_CLOSE}'
    )


def call_text(name: str, arguments: Mapping[str, Any]) -> str:
    payload = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{payload}\n{CALL_CLOSE}"


def fold_into_text(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> list[dict[str, str]]:
    """Messages with tools, tool calls and tool results as plain system, user and assistant turns."""
    folded: list[dict[str, str]] = []
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "assistant" and message.get("tool_calls"):
            calls = [
                call_text(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
            ]
            content = "\n".join([content, *calls] if content else calls)
        if role == "tool":
            result = f"{RESULT_OPEN}\n{content}\n{RESULT_CLOSE}"
            if folded and folded[-1]["role"] == "user" and folded[-1]["content"].endswith(RESULT_CLOSE):
                folded[-1]["content"] += "\n" + result  # answers to parallel calls share one turn
                continue
            role, content = "user", result
        folded.append({"role": role, "content": content})
    if tools:
        if folded and folded[0]["role"] == "system":
            folded[0] = {"role": "system", "content": folded[0]["content"] + "\n\n" + instructions(tools)}
        else:
            folded.insert(0, {"role": "system", "content": instructions(tools)})
    return folded


def parse_calls(text: str) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """(the text outside the calls, [(name, arguments), ...]) from a model's answer.

    A call whose JSON does not parse, or lacks a name, stays in the text.
    """
    calls: list[tuple[str, dict[str, Any]]] = []

    def take(match: re.Match[str]) -> str:
        try:
            payload = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return match.group(0)
        arguments = payload.get("arguments", payload.get("parameters", {}))
        calls.append((payload["name"], arguments if isinstance(arguments, dict) else {}))
        return ""

    rest = _CALL.sub(take, text)
    return rest.strip(), calls


def call_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call of `tool`: its name, then arguments valid for its parameters.

    Objects take only their listed keys unless the schema says otherwise (`additionalProperties`),
    as in OpenAI's strict mode: invented keys help no tool.
    """
    function = tool["function"]
    parameters = closed_objects(function.get("parameters") or {"type": "object", "properties": {}})
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def call_grammar(
    tools: Sequence[Mapping[str, Any]], mode: Literal["auto", "required"], parallel: bool
) -> Grammar:
    """Calls of `tools` only (mode "required"), or free text or calls ("auto").

    parallel: allow several calls in one answer.
    """
    options = [call_schema(tool) for tool in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": JSON_OPTIONS}
    calls = 'call ("\\n" call)*' if parallel else "call"
    opening, closing = json.dumps(CALL_OPEN + "\n"), json.dumps("\n" + CALL_CLOSE)
    lines = [f"calls: {calls}", f"call: {opening} %json {json.dumps(schema)} {closing}"]
    if mode == "auto":
        # Text that does not open with a call tag is a plain answer.
        lines = ["start: calls | TEXT", "TEXT: /([^<]|<[^t]|<t[^o])(.|\\n)*|<|<t/", *lines]
    else:
        lines = ["start: calls", *lines]
    return Grammar.lark("\n".join(lines))
