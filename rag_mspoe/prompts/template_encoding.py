"""Token ids of a chat prompt in which only the chat template's own markers are control tokens.

Message contents, tool definitions (their keys included), tool calls and their arguments come from
users, documents and tools. A tokenizer reads an added token's text anywhere in its input as that
token, whether or not it is flagged special: a document holding '<|im_start|>system' would open a
real system turn, and in Qwen's vocabulary '<tool_call>' (an added token not flagged special) would
write a real tool call. Here the text of every added or special token inside those strings is
swapped for a placeholder before the template renders; after it, the template's text is encoded as
usual and each placeholder as its original text in the base vocabulary, where no added token exists.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any


def added_texts(tokenizer: Any) -> list[str]:
    """The texts a tokenizer reads as single added tokens, special or not ('<|im_start|>',
    Qwen's '<tool_call>'), longest first so that no prefix of one wins over it."""
    texts = set(getattr(tokenizer, "all_special_tokens", None) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts.update(str(token) for token in added.values())
    return sorted((t for t in texts if t), key=lambda t: (-len(t), t))


def base_vocabulary_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` as ordinary text: the tokenizer's normalizer, pre-tokenizer and model
    without its added vocabulary, so no added token can come out."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a Python tokenizer: splitting "special" tokens splits every added one
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    normalized = backend.normalizer.normalize_str(text) if backend.normalizer else text
    pieces = (
        backend.pre_tokenizer.pre_tokenize_str(normalized) if backend.pre_tokenizer else [(normalized, None)]
    )
    return [token.id for piece, _ in pieces for token in backend.model.tokenize(piece)]


class SpecialTextMask:
    """Swaps added tokens' texts in untrusted strings for placeholders, and encodes the result."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.specials = added_texts(tokenizer)
        self._numbers = {text: number for number, text in enumerate(self.specials)}
        # A fresh random tag per prompt: no user text can forge a placeholder.
        tag = "ZSPECIAL" + secrets.token_hex(8)
        self._placeholders = re.compile(f"{tag}(\\d+){tag}")
        self._tag = tag
        self._found = re.compile("|".join(re.escape(t) for t in self.specials)) if self.specials else None

    def text(self, value: str) -> str:
        """`value` with every added token's text replaced by its placeholder."""
        if self._found is None:
            return value
        return self._found.sub(lambda match: f"{self._tag}{self._numbers[match.group()]}{self._tag}", value)

    def value(self, value: Any) -> Any:
        """A message, tool or argument structure with `text` applied to every string in it, the
        keys of its mappings included (a schema's property names, a call's argument names)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {self.value(key): self.value(item) for key, item in value.items()}
        if isinstance(value, Sequence):
            return [self.value(item) for item in value]
        return value

    def encode(self, rendered: str) -> list[int]:
        """Token ids of rendered text: the template's markers control tokens, each placeholder plain text."""
        return self._encoded(self._rendered_pieces(rendered), None)

    def encode_with_offsets(self, rendered: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode`'s ids and each token's character range [start, end) in `rendered` (a
        placeholder's tokens all cover the placeholder). Needs a fast tokenizer."""
        offsets: list[tuple[int, int]] = []
        return self._encoded(self._rendered_pieces(rendered), offsets), offsets

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of untrusted text on its own, every added token's text as plain text."""
        return self._encoded(self._plain_pieces(text), None)

    def encode_plain_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode_plain`'s ids and each token's character range in `text` (the tokens of an added
        token's text all cover it). Needs a fast tokenizer."""
        offsets: list[tuple[int, int]] = []
        return self._encoded(self._plain_pieces(text), offsets), offsets

    def _plain_pieces(self, text: str) -> Iterator[tuple[int, int, str, bool]]:
        """`_rendered_pieces` of untrusted text: its added tokens' texts are the pieces to spell out."""
        cursor = 0
        for match in self._found.finditer(text) if self._found else ():
            yield cursor, match.start(), text[cursor : match.start()], False
            yield match.start(), match.end(), match.group(), True
            cursor = match.end()
        yield cursor, len(text), text[cursor:], False

    def _rendered_pieces(self, rendered: str) -> Iterator[tuple[int, int, str, bool]]:
        """(start, end, text, whether it is an added token's text to spell out) of each piece."""
        cursor = 0
        for index, piece in enumerate(self._placeholders.split(rendered)):
            if index % 2:  # a placeholder's number
                end = cursor + 2 * len(self._tag) + len(piece)
                yield cursor, end, self.specials[int(piece)], True
            else:
                end = cursor + len(piece)
                yield cursor, end, piece, False
            cursor = end

    def _encoded(
        self, pieces: Iterator[tuple[int, int, str, bool]], offsets: list[tuple[int, int]] | None
    ) -> list[int]:
        """The ids of the pieces in turn; each token's character range appended to `offsets`
        unless it is None. The template's pieces are encoded in one batch, each added token's
        text once."""
        kept = [piece for piece in pieces if piece[2]]
        texts = [text for _, _, text, spelled in kept if not spelled]
        encoded: Any = {"input_ids": [], "offset_mapping": []}
        if texts:
            encoded = (
                self._with_offsets(texts)
                if offsets is not None
                else self.tokenizer(texts, add_special_tokens=False)
            )
        spelled_ids: dict[str, list[int]] = {}
        template_piece = 0
        ids: list[int] = []
        for start, end, text, spelled in kept:
            if spelled:
                if text not in spelled_ids:
                    spelled_ids[text] = base_vocabulary_ids(self.tokenizer, text)
                piece_ids = spelled_ids[text]
                piece_offsets = [(start, end)] * len(piece_ids)
            else:
                piece_ids = encoded["input_ids"][template_piece]
                if offsets is not None:
                    piece_offsets = [
                        (start + a, start + b) for a, b in encoded["offset_mapping"][template_piece]
                    ]
                template_piece += 1
            ids += piece_ids
            if offsets is not None:
                offsets += piece_offsets
        return ids

    def _with_offsets(self, texts: list[str]) -> Any:
        if not getattr(self.tokenizer, "is_fast", False):
            raise TypeError(
                "Finding where documents are in a prompt needs a fast tokenizer (one with offset "
                f"mappings); {type(self.tokenizer).__name__} is not. Load the model's tokenizer with "
                "use_fast=True."
            )
        return self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)


def encode_untrusted(tokenizer: Any, render: Callable[[SpecialTextMask], str], prefix: str = "") -> list[int]:
    """Token ids of `render(mask) + prefix`, where `render` passes every untrusted string through
    `mask.value` before the template sees it; the prefix is untrusted text too."""
    mask = SpecialTextMask(tokenizer)
    # Without added tokens' texts in untrusted strings this is one encoding of the whole text, as before.
    return mask.encode(render(mask) + mask.text(prefix))
