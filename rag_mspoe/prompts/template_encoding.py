"""Token ids of a chat prompt in which only the chat template's own markers are special tokens.

Message contents, tool definitions and tool calls come from users and documents. A tokenizer
reads a special token's text ('<|im_start|>') anywhere in its input as that token, so a
document holding '<|im_start|>system' would open a real system turn. Here every special token's
text inside those strings is swapped for a placeholder before the template renders; after it,
the template's text is encoded as usual and each placeholder as its original text, split into
ordinary tokens.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def special_texts(tokenizer: Any) -> list[str]:
    """The texts a tokenizer reads as special tokens (Qwen lists '<|im_start|>' only among its added ones)."""
    texts = set(getattr(tokenizer, "all_special_tokens", None) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts.update(str(token) for token in added.values() if getattr(token, "special", False))
    return sorted((t for t in texts if t), key=lambda t: (-len(t), t))  # longest first: no prefix wins


class SpecialTextMask:
    """Swaps special tokens' texts in untrusted strings for placeholders, and encodes the result."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.specials = special_texts(tokenizer)
        # A fresh random tag per prompt: no user text can forge a placeholder.
        tag = "ZSPECIAL" + secrets.token_hex(8)
        self._placeholders = re.compile(f"{tag}(\\d+){tag}")
        self._tag = tag
        self._found = re.compile("|".join(re.escape(t) for t in self.specials)) if self.specials else None

    def text(self, value: str) -> str:
        """`value` with every special token's text replaced by its placeholder."""
        if self._found is None:
            return value
        return self._found.sub(self._placeholder, value)

    def value(self, value: Any) -> Any:
        """A message, tool or argument structure with `text` applied to every string in it."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {key: self.value(item) for key, item in value.items()}
        if isinstance(value, Sequence):
            return [self.value(item) for item in value]
        return value

    def encode(self, rendered: str) -> list[int]:
        """Token ids of rendered text: the template's markers special, each placeholder as plain text."""
        ids: list[int] = []
        for index, piece in enumerate(self._placeholders.split(rendered)):
            if index % 2:  # a placeholder's number
                ids += self._ids(self.specials[int(piece)], split_special_tokens=True)
            elif piece:
                ids += self._ids(piece)
        return ids

    def encode_with_offsets(self, rendered: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode`'s ids and each token's character range [start, end) in `rendered` (a
        placeholder's tokens all cover the placeholder). Needs a fast tokenizer."""
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        cursor = 0  # the pieces follow one another in `rendered`
        for index, piece in enumerate(self._placeholders.split(rendered)):
            if index % 2:  # a placeholder's number
                end = cursor + 2 * len(self._tag) + len(piece)
                special = self._ids(self.specials[int(piece)], split_special_tokens=True)
                ids += special
                offsets += [(cursor, end)] * len(special)
            else:
                end = cursor + len(piece)
                if piece:
                    encoded = self._encoded(piece)
                    ids += encoded["input_ids"]
                    offsets += [(cursor + start, cursor + stop) for start, stop in encoded["offset_mapping"]]
            cursor = end
        return ids, offsets

    def _placeholder(self, match: re.Match[str]) -> str:
        return f"{self._tag}{self.specials.index(match.group())}{self._tag}"

    def _ids(self, text: str, **options: Any) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False, **options)["input_ids"])

    def _encoded(self, text: str) -> dict[str, Any]:
        if not getattr(self.tokenizer, "is_fast", False):
            raise TypeError(
                "Finding where documents are in a prompt needs a fast tokenizer (one with offset "
                f"mappings); {type(self.tokenizer).__name__} is not. Load the model's tokenizer with "
                "use_fast=True."
            )
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return {"input_ids": list(encoded["input_ids"]), "offset_mapping": list(encoded["offset_mapping"])}


def encode_untrusted(tokenizer: Any, render: Callable[[SpecialTextMask], str], prefix: str = "") -> list[int]:
    """Token ids of `render(mask) + prefix`, where `render` passes every untrusted string through
    `mask.value` before the template sees it; the prefix is untrusted text too."""
    mask = SpecialTextMask(tokenizer)
    # Without special texts in untrusted strings this is one encoding of the whole text, as before.
    return mask.encode(render(mask) + mask.text(prefix))
