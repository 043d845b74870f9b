"""Turn a prompt (text or chat messages) into the token ids the model sees.

A string becomes one user turn of the model's chat template; a list of {"role", "content"} dicts
is rendered as a conversation. `raw=True` skips the template for plain text continuation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Message = Mapping[str, str]
Prompt = str | Sequence[Message]

ROLES = ("system", "user", "assistant")


def as_messages(prompt: Prompt) -> list[dict[str, str]]:
    """Check a prompt and return it as a list of {"role", "content"} dicts."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, Sequence) or not prompt:
        raise TypeError(
            "A prompt is a string or a non-empty list of {'role', 'content'} dicts, "
            f"got {type(prompt).__name__}."
        )
    messages = []
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise TypeError(f"Message {i} must be a dict with 'role' and 'content' keys, got {message!r}.")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise ValueError(f"Message {i} has role {role!r}; use one of {', '.join(ROLES)}.")
        if not isinstance(content, str):
            raise TypeError(
                f"Message {i} content must be a string (this model reads text only), got {content!r}."
            )
        messages.append({"role": role, "content": content})
    return messages


def render(tokenizer: Any, prompt: Prompt, *, raw: bool = False, prefix: str = "") -> list[int]:
    """Token ids for a prompt: the chat template with the assistant turn opened, or plain text if raw.

    prefix: text the answer starts with, tokenized together with the prompt so the boundary
    splits into tokens the way the model would have written it.
    """
    if raw:
        if not isinstance(prompt, str):
            raise TypeError("raw=True takes a plain string prompt; pass messages without raw=True.")
        return list(tokenizer(prompt + prefix, add_special_tokens=True)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "This tokenizer has no chat template; set tokenizer.chat_template, "
            "or pass raw=True for plain text."
        )
    text = tokenizer.apply_chat_template(as_messages(prompt), add_generation_prompt=True, tokenize=False)
    # The template already writes any special tokens (BOS included) the model expects.
    return list(tokenizer(text + prefix, add_special_tokens=False)["input_ids"])
