"""Turn a prompt (text or chat messages, tools included) into the token ids the model sees.

A string becomes one user turn of the model's chat template; a list of {"role", "content"} dicts
is rendered as a conversation. `raw=True` skips the template for plain text continuation.
Only the template writes control tokens: text in messages, tools (their keys included), tool
calls and the prefix that spells an added token ('<|im_start|>', '<tool_call>') is encoded as
plain text (`rag_mspoe.prompts.template_encoding`).

Tool use follows the OpenAI message shapes: an assistant message may carry `tool_calls`
([{"id", "type": "function", "function": {"name", "arguments"}}]) and a "tool" message answers
one call (`tool_call_id`). Templates that know tools get them (`tools=`) and these messages as they
are; for the others `rag_mspoe.tools.tool_format` writes them into the conversation as text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rag_mspoe.prompts.template_encoding import encode_untrusted
from rag_mspoe.tools import tool_format

Message = Mapping[str, Any]
Prompt = str | Sequence[Message]

ROLES = ("system", "user", "assistant", "tool")
# How deep a tool call's arguments may nest: the masking and the template walk them recursively,
# and real arguments nest a few levels (600 overflowed Python's stack).
MAX_ARGUMENT_DEPTH = 64
# A message's optional list of [start, end) character ranges of the documents in its content
# (`rag_mspoe.prompts.document_prompts`); the chat template never sees it.
DOCUMENT_SPANS = "document_spans"


class PromptError(ValueError, TypeError):
    """A prompt the model cannot be given as it is (a message, a tool call or a document span of
    the wrong shape); the message names the part and the fix. A server answers it with a 400.
    A TypeError too, since a part of the wrong type is one such case and callers caught that."""


class EmptyPromptError(PromptError):
    """A prompt that gives the model no token at all."""


def as_messages(prompt: Prompt) -> list[dict[str, Any]]:
    """Check a prompt and return it as a list of message dicts (tool calls with dict arguments)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, Sequence) or not prompt:
        raise PromptError(
            "A prompt is a string or a non-empty list of {'role', 'content'} dicts, "
            f"got {type(prompt).__name__}."
        )
    messages = []
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise PromptError(f"Message {i} must be a dict with 'role' and 'content' keys, got {message!r}.")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise PromptError(f"Message {i} has role {role!r}; use one of {', '.join(ROLES)}.")
        calls = message.get("tool_calls") or []
        if role == "assistant" and content is None and calls:
            content = ""  # an assistant turn that only calls tools
        if not isinstance(content, str):
            raise PromptError(
                f"Message {i} content must be a string (this model reads text only), got {content!r}."
            )
        if not _is_unicode(content):
            raise PromptError(f"Message {i} content holds a lone surrogate ({_SURROGATE_FIX}).")
        converted: dict[str, Any] = {"role": role, "content": content}
        if calls:
            if role != "assistant":
                raise PromptError(f"Message {i}: only assistant messages carry tool_calls, not {role!r}.")
            converted["tool_calls"] = [_tool_call(call, i) for call in calls]
        if role == "tool" and message.get("tool_call_id"):
            converted["tool_call_id"] = str(message["tool_call_id"])
        if role == "tool" and message.get("name"):
            converted["name"] = str(message["name"])
        if message.get(DOCUMENT_SPANS) is not None:
            converted[DOCUMENT_SPANS] = _document_spans(message[DOCUMENT_SPANS], content, i)
        messages.append(converted)
    return messages


def _document_spans(spans: Any, content: str, index: int) -> list[tuple[int, int]]:
    try:
        pairs = [(start, end) for start, end in spans]
    except (TypeError, ValueError):
        pairs = None
    if pairs is None or not all(
        isinstance(v, int) and not isinstance(v, bool) for pair in pairs for v in pair
    ):
        raise PromptError(
            f"Message {index}: document_spans is a list of [start, end] character offsets into its "
            f"content, got {spans!r}."
        )
    previous_end = 0
    for start, end in pairs:
        if not previous_end <= start < end <= len(content):
            raise PromptError(
                f"Message {index}: the document span [{start}, {end}) is not inside its "
                f"{len(content)}-character content, or overlaps the one before; give each "
                "document's [start, end) once, in order."
            )
        previous_end = end
    return pairs


def _tool_call(call: Any, index: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise PromptError(
            f"Message {index}: a tool call is "
            f"{{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}, got {call!r}."
        )
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):  # the OpenAI wire format sends arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):  # RecursionError: nested past the stack
            raise PromptError(
                f"Message {index}: the arguments of the call of {function['name']!r} are not JSON: "
                f'{arguments[:200]!r}; send them as a JSON object\'s text, e.g. \'{{"city": "Paris"}}\'.'
            ) from None
    if not isinstance(arguments, Mapping):
        raise PromptError(
            f"Message {index}: the arguments of the call of {function['name']!r} must be a JSON "
            f"object (named arguments), got {arguments!r}."
        )
    problem = _argument_problem(arguments)
    if problem:
        raise PromptError(f"Message {index}: the arguments of the call of {function['name']!r} {problem}.")
    return {
        "id": str(call.get("id") or ""),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


_SURROGATE_FIX = "half of a UTF-16 pair, which no UTF-8 text holds; send the whole character"


def _is_unicode(text: str) -> bool:
    """Whether `text` is encodable text: a lone surrogate ('\\ud800' decoded from JSON) is not,
    and the tokenizer fails on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _argument_problem(arguments: Mapping[str, Any]) -> str | None:
    """What makes parsed arguments unusable (too deep, a lone surrogate), or None; walked with a
    stack, not recursion, since the depth is what is checked."""
    stack: list[tuple[Any, int]] = [(arguments, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_ARGUMENT_DEPTH:
            return f"nest deeper than {MAX_ARGUMENT_DEPTH} levels; send flatter arguments"
        if isinstance(value, str) and not _is_unicode(value):
            return f"hold a lone surrogate ({_SURROGATE_FIX})"
        if isinstance(value, Mapping):
            stack += [(key, depth) for key in value] + [(item, depth + 1) for item in value.values()]
        elif isinstance(value, list | tuple):
            stack += [(item, depth + 1) for item in value]
    return None


def _without_spans(message: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in message.items() if key != DOCUMENT_SPANS}


def knows_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders tools itself (Qwen2.5, Llama 3.1, Mistral, ...)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def render(
    tokenizer: Any,
    prompt: Prompt,
    *,
    raw: bool = False,
    prefix: str = "",
    tools: Sequence[Mapping[str, Any]] = (),
) -> list[int]:
    """Token ids for a prompt: the chat template with the assistant turn opened, or plain text if raw.

    prefix: text the answer starts with, tokenized together with the prompt so the boundary
    splits into tokens the way the model would have written it.
    tools: OpenAI-style tool definitions the model may call.
    """
    if raw:
        # The caller writes the whole text, special tokens included, like a template of its own.
        ids = list(tokenizer(raw_text(prompt, tools) + prefix, add_special_tokens=True)["input_ids"])
        if not ids:
            raise EmptyPromptError(
                "The prompt is empty: with raw=True the model needs at least one token to continue; "
                "pass some text, or drop raw=True to send it through the chat template."
            )
        return ids
    # The template writes the special tokens (BOS included) the model expects; the messages' own
    # text, the tools and the prefix are encoded as plain text even where they spell a special token.
    return encode_untrusted(
        tokenizer, lambda mask: render_text(tokenizer, prompt, tools=tools, untrusted=mask.value), prefix
    )


def raw_text(prompt: Prompt, tools: Sequence[Mapping[str, Any]] = ()) -> str:
    """A raw=True prompt: plain text the model continues, without the chat template. It is a
    string, or one message whose content is the text (so it can say where its documents are)."""
    if tools:
        raise PromptError("raw=True cannot show tools to the model; send messages through the chat template.")
    if isinstance(prompt, str):
        return prompt
    messages = as_messages(prompt)
    if len(messages) != 1:
        raise PromptError(
            f"raw=True takes a plain string prompt or one message, got {len(messages)} messages; pass "
            "them without raw=True to use the chat template."
        )
    content: str = messages[0]["content"]
    return content


def render_text(
    tokenizer: Any,
    prompt: Prompt,
    *,
    tools: Sequence[Mapping[str, Any]] = (),
    untrusted: Callable[[Any], Any] = lambda value: value,
) -> str:
    """The chat template's text for a prompt, up to the opened assistant turn.

    untrusted: applied to the messages and the tools before the template sees them.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "This tokenizer has no chat template; set tokenizer.chat_template, "
            "or pass raw=True for plain text."
        )
    messages = untrusted([_without_spans(m) for m in as_messages(prompt)])
    tools = untrusted(list(tools))
    uses_tools = bool(tools) or any(m["role"] == "tool" or "tool_calls" in m for m in messages)
    options: dict[str, Any] = {}
    if uses_tools and knows_tools(tokenizer):
        options["tools"] = list(tools) or None
    elif uses_tools:
        messages = tool_format.fold_into_text(messages, tools)
    return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **options))
