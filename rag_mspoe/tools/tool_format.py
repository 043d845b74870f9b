"""How tool calls look as text, per model family: written, detected and parsed in one place.

Each instruct model was trained to call tools in its own format, which its chat template's tool
section describes. `format_for(tokenizer)` reads it from the template:

    hermes   Qwen2.5, Qwen3, Hermes   <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
    llama3   Llama 3.1 / 3.2          {"name": ..., "parameters": {...}}
    mistral  Mistral (v3 template)    [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]

A template that does not render tools (SmolLM2, Gemma 3) gets the tool list folded into its
system turn by `fold_into_text`, earlier calls into the assistant turns and tool results into user
turns, all in the hermes format as plain text.

`parse_calls` reads calls back from an answer whatever the format: tagged calls anywhere in the
text, and an answer that is nothing but a call's JSON (bare, a list of calls, or in a ```json
fence: what models write when left free, and what the llama3 and mistral formats are once their
special marker tokens are dropped from the decoded text).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rag_mspoe.tools.grammar import closed_objects
from rag_mspoe.tools.text_markers import unfinished_tail

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# A tagged call; an unclosed one at the very end counts too (the model stopped before the tag).
_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CALL_CLOSE) + r"|\Z)", re.DOTALL)
_FENCE = re.compile(r"```(?:json)?\s*\n(.*?)\n?\s*```", re.DOTALL)
_THINKING = re.compile(r"\s*" + re.escape(THINK_OPEN) + r".*?" + re.escape(THINK_CLOSE), re.DOTALL)
# Text dropped before a call's JSON in bare form: markers some formats put there.
BARE_MARKERS = ("[TOOL_CALLS]", "<|python_tag|>")
# How an answer that is a call's bare JSON starts, whitespace removed (markers dropped or not).
_BARE_OPENINGS = tuple(
    start + body for start in ("", "```json", "```", *BARE_MARKERS) for body in ('{"name":', '[{"name":')
)


@dataclass(frozen=True)
class CallFormat:
    """One family's way of writing calls.

    open/close: the markers around each call (hermes) or before the list of calls (mistral);
    arguments_key: what the call's JSON names the arguments;
    as_list: the calls are one JSON array after `open`, rather than one marked object each;
    thinks: the model may reason in <think>...</think> before answering (Qwen3).
    """

    name: str
    open: str = ""
    close: str = ""
    arguments_key: str = "arguments"
    as_list: bool = False
    thinks: bool = False


HERMES = CallFormat("hermes", open=CALL_OPEN, close=CALL_CLOSE)
LLAMA3 = CallFormat("llama3", arguments_key="parameters")
MISTRAL = CallFormat("mistral", open="[TOOL_CALLS]", as_list=True)


def format_for(tokenizer: Any) -> CallFormat:
    """The call format the tokenizer's chat template teaches its model (hermes when it shows none)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tools" not in template:
        return HERMES  # folded into the conversation as text
    if MISTRAL.open in template:
        return MISTRAL
    if CALL_OPEN in template:
        return dataclasses.replace(HERMES, thinks=THINK_OPEN in template)
    if '"parameters"' in template and ("<|python_tag|>" in template or "ipython" in template):
        return LLAMA3
    return HERMES


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


ParsedCall = tuple[str, dict[str, Any]]


def parse_calls(
    text: str, tool_names: Collection[str] | None = None, *, cut: bool = False
) -> tuple[str, list[ParsedCall]]:
    """(the text outside the calls, [(name, arguments), ...]) from a model's answer.

    Tagged calls are read anywhere; an answer that is only JSON is a call when that JSON is a call
    (or a list of calls) of a tool in `tool_names` (any name when None). A tagged call whose JSON
    does not parse, or lacks a name, stays in the text.

    cut: the answer was cut off by the token limit. Then a call it was still writing is neither a
    call nor text (as the OpenAI API does, with finish reason "length"): an unclosed tagged call
    whose JSON is unfinished, a bare call's unfinished JSON, a call tag half written at the end.
    """
    if cut:
        text = text[: len(text) - unfinished_tail(text, (CALL_OPEN,))]
    calls: list[ParsedCall] = []

    def take(match: re.Match[str]) -> str:
        closed = match.group(0).endswith(CALL_CLOSE)
        call = call_of(match.group(1)) if closed else unclosed_call(match.group(1))
        if call is None:
            return "" if cut and not closed else match.group(0)
        calls.append(call)
        return ""

    rest = _CALL.sub(take, text)
    if not calls:
        thinking, answer = split_thinking(text)
        bare = bare_calls(answer, tool_names)
        if bare:
            return thinking.strip(), bare
        if cut and unfinished_bare_call(answer):
            return thinking.strip(), []
    return rest.strip(), calls


def unclosed_call(body: str) -> ParsedCall | None:
    """The call of a tagged call's text that ends without its closing tag (perhaps half of it)."""
    body = body.rstrip()
    return call_of(body[: len(body) - unfinished_tail(body, (CALL_CLOSE,))].strip())


def may_be_bare_call(answer: str) -> bool:
    """Whether an answer starts, or may yet start, like a call's bare JSON (markers and a ```json
    fence allowed, whitespace ignored)."""
    squeezed = "".join(answer.split())
    return any(o.startswith(squeezed) or squeezed.startswith(o) for o in _BARE_OPENINGS)


def unfinished_bare_call(answer: str) -> bool:
    """Whether an answer is the start of a call's bare JSON that never ended."""
    return CALL_OPEN not in answer and may_be_bare_call(answer) and _bare_payload(answer) is None


def split_thinking(text: str) -> tuple[str, str]:
    """(a leading <think>...</think> block, the rest of the answer)."""
    match = _THINKING.match(text)
    return (text[: match.end()], text[match.end() :]) if match else ("", text)


def bare_calls(answer: str, tool_names: Collection[str] | None = None) -> list[ParsedCall]:
    """The calls of an answer that is only a call's JSON (or a list of them), bare or fenced,
    after any marker token; [] for any other answer."""
    payload = _bare_payload(answer)
    if payload is None:
        return []
    entries = payload if isinstance(payload, list) and payload else [payload]
    calls = [call_of(entry) for entry in entries]
    if not all(call is not None and (tool_names is None or call[0] in tool_names) for call in calls):
        return []
    return [call for call in calls if call is not None]


def _bare_payload(answer: str) -> Any:
    """The JSON of an answer that is only JSON, bare or fenced, after any marker; None if it is not."""
    body = answer.strip()
    for marker in BARE_MARKERS:
        body = body.removeprefix(marker).strip()
    fenced = _FENCE.fullmatch(body)
    try:
        return json.loads(fenced.group(1) if fenced else body)
    except json.JSONDecodeError:
        return None


def call_of(payload: Any) -> ParsedCall | None:
    """(name, arguments) of a call's JSON (text or parsed), or None if it is not a call."""
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except json.JSONDecodeError:
            return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = argument_object(payload.get("arguments", payload.get("parameters", {})))
    return None if arguments is None else (payload["name"], arguments)


def argument_object(arguments: Any) -> dict[str, Any] | None:
    """A call's arguments as a dict: models and templates may write them as JSON text (None if
    that text does not parse); anything but an object counts as no arguments."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return arguments if isinstance(arguments, dict) else {}


def call_schema(tool: Mapping[str, Any], arguments_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call of `tool`: its name, then arguments valid for its parameters.

    Objects take only their listed keys unless the schema says otherwise (`additionalProperties`),
    as in OpenAI's strict mode: invented keys help no tool.
    """
    function = tool["function"]
    parameters = closed_objects(function.get("parameters") or {"type": "object", "properties": {}})
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }
