"""The grammar of the tool calls a model may write, in its own call format (`tool_format`).

A call's JSON is held to its tool's schema; the markers around it (`<tool_call>`, `[TOOL_CALLS]`)
are written the way the model's tokenizer spells them: a marker that is one added token of the
vocabulary is that token (llguidance treats added tokens as special: spelled as text it would be
a different token sequence from the one the model was trained to write, and the matcher would
refuse the model's own token), any other marker is text.

tool_choice "required" allows only calls. "auto" also allows a plain text answer, and the call's
JSON without its markers, bare or in a ```json fence, as small models often write it when left
free; an answer that starts like a call must then be a valid one, and a text answer never holds
a <tool_call> tag spelled out in text (`parse_calls` would read a call there that no schema held).
Qwen3-style templates may open the answer with a <think>...</think> block.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from rag_mspoe.tools.grammar import JSON_OPTIONS, Grammar
from rag_mspoe.tools.tool_format import (
    BARE_MARKERS,
    CALL_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    CallFormat,
    call_schema,
)

_TEXT = r"(.|\n)*"
_REGEX_SPECIAL = set("\\.+*?()|[]{}^$/-")


def _escaped(text: str) -> str:
    return "".join(f"\\{c}" if c in _REGEX_SPECIAL else c for c in text)


# What a text answer may not start with, as `parse_calls` would read a call there: a JSON object
# or list, a ```json fence, a marker that goes before bare calls (spelled out as text).
_CALL_LIKE = r"\s*(\{|\[\s*\{|```json|" + "|".join(_escaped(m) for m in BARE_MARKERS) + ")"
# Nor hold a tagged call anywhere: the tag read as text would open a call no schema held.
_TAGGED = _TEXT + _escaped(CALL_OPEN) + _TEXT


def marker(tokenizer: Any, text: str) -> str | None:
    """A marker's token as a grammar expression (`<[id]>`) if it is one added token, else None."""
    token_id = (tokenizer.get_added_vocab() or {}).get(text)
    return f"<[{token_id}]>" if token_id is not None else None


def call_grammar(
    tokenizer: Any,
    fmt: CallFormat,
    tools: Sequence[Mapping[str, Any]],
    mode: Literal["auto", "required"],
    parallel: bool,
) -> Grammar:
    """Calls of `tools` in `fmt` only (mode "required"), or also free text ("auto").

    parallel: allow several calls in one answer.
    """
    options = [call_schema(tool, fmt.arguments_key) for tool in tools]
    one: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    listed = {"type": "array", "items": one, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    as_json = _schema_text(one)
    lines = []
    if fmt.as_list:
        lines.append(f'calls: {_spelled(tokenizer, fmt.open)} " " %json {_schema_text(listed)}')
    elif fmt.open:
        opening = f'{_spelled(tokenizer, fmt.open)} "\\n"'
        closing = f'"\\n" {_spelled(tokenizer, fmt.close)}'
        lines.append(f"call: {opening} %json {as_json} {closing}")
        # Calls one per line; a line break may close the last (models trained on Qwen's template
        # write one, and the end of turn after it).
        lines.append('calls: call ("\\n" call)* "\\n"?' if parallel else "calls: call")
    else:
        lines.append(f"calls: %json {as_json}")
    answer = "calls"
    if mode == "auto":
        # The call's JSON alone (a list of calls, if parallel), bare or fenced; or plain text.
        bare = f"%json {_schema_text({'anyOf': [one, listed]} if parallel else one)}"
        lines += [
            f"bare: {bare}",
            'fenced: "```json\\n" bare "\\n```"',
            f"TEXT: /{_TEXT}/ & ~/{_CALL_LIKE}{_TEXT}/ & ~/{_TAGGED}/",
        ]
        answer = "calls | fenced | TEXT" if not fmt.open else "calls | bare | fenced | TEXT"
    lines.insert(0, f"start: {_thinking(tokenizer, fmt)}({answer})")
    return Grammar.lark("\n".join(lines))


def _spelled(tokenizer: Any, text: str) -> str:
    return marker(tokenizer, text) or json.dumps(text)


def _thinking(tokenizer: Any, fmt: CallFormat) -> str:
    """An optional leading <think>...</think> block, where the format thinks and the tags are tokens."""
    opened, closed = marker(tokenizer, THINK_OPEN), marker(tokenizer, THINK_CLOSE)
    if not (fmt.thinks and opened and closed):
        return ""
    return f"({opened} /{_TEXT}/ {closed} /[ \\n]*/)? "


def _schema_text(schema: Mapping[str, Any]) -> str:
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS})
