"""Reading tool calls back out of an answer: with transformers' response parsing where the
tokenizer declares how its model's answers look, else with the project's own call format.

A tokenizer declares it in its `response_template` (transformers 5: a tokenizer_config.json key,
or set on the tokenizer), a description of where an answer's content, reasoning and calls sit;
`tokenizer.parse_response` reads an answer with it. Without one, `tool_format.parse_calls` reads
the calls in any of the formats the constrained grammar writes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rag_mspoe.prompts.chat_template import Prompt, render_text
from rag_mspoe.tools import tool_format

ParsedCalls = list[tuple[str, dict[str, Any]]]


def response_template(tokenizer: Any) -> Mapping[str, Any] | None:
    """The response template a tokenizer declares, or None."""
    template = getattr(tokenizer, "response_template", None)
    return template if isinstance(template, Mapping) else None


def parse_answer(
    tokenizer: Any, text: str, prompt: Prompt, tools: Sequence[Mapping[str, Any]], cut: bool = False
) -> tuple[str, ParsedCalls]:
    """(the answer's text outside calls, [(name, arguments), ...]).

    prompt and tools are those the answer was generated for: a response template reads the
    answer after the prompt's text (templates may open part of the answer in the prompt).
    cut: the token limit ended the answer; our parser then drops a call it was still writing
    (`tool_format.parse_calls`), a response template reads the answer as it declares.
    """
    template = response_template(tokenizer)
    if template is None:
        return tool_format.parse_calls(text, [tool["function"]["name"] for tool in tools], cut=cut)
    prefix = render_text(tokenizer, prompt, tools=tools)
    parsed = tokenizer.parse_response(text, dict(template), prefix=prefix, tools=[dict(t) for t in tools])
    calls = [_call(entry) for entry in parsed.get("tool_calls") or []]
    content = parsed.get("content")
    return (content.strip() if isinstance(content, str) else ""), [c for c in calls if c is not None]


def _call(entry: Any) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of one parsed call: {"type": "function", "function": {...}} or {"name", ...}."""
    function = entry.get("function", entry) if isinstance(entry, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        return None
    arguments = tool_format.argument_object(function.get("arguments", {}))
    return None if arguments is None else (function["name"], arguments)
