"""Document spans: where each document sits in a prompt's tokens, and how they reach a model.

Text-level code (the packer, the evaluation's prompts) knows each document's *character* span in
the user message; `prompt_with_spans` renders the chat template and turns those into *token*
spans of the rendered prompt with the tokenizer's offset mapping. A method that sees documents
reads the spans of the prompts it runs on from `document_spans(model, spans)`:

    ids, spans = prompt_with_spans(tokenizer, packed.prompt, packed.document_spans)
    with document_spans(model, [spans]):
        model(torch.tensor([ids]))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

Span = tuple[int, int]  # [start, end) of one document


@dataclass(frozen=True)
class DocumentSpans:
    """Per batch row, the token ranges [start, end) of its documents, in prompt order.

    Indices count the row's own tokens, before any left padding (the hooks shift them by the
    padding the attention mask shows). A row with no spans is a prompt without documents.
    """

    rows: tuple[tuple[Span, ...], ...]

    def __post_init__(self) -> None:
        for index, row in enumerate(self.rows):
            previous_end = 0
            for start, end in row:
                if not (isinstance(start, int) and isinstance(end, int)) or not 0 <= start < end:
                    raise ValueError(
                        f"Row {index} has the document span ({start}, {end}); a span is two token "
                        "indices with 0 <= start < end."
                    )
                if start < previous_end:
                    raise ValueError(
                        f"Row {index}: the document spans {list(row)} overlap or are out of order; "
                        "give each document's tokens once, in prompt order."
                    )
                previous_end = end

    @classmethod
    def of(cls, spans: DocumentSpans | Sequence[Sequence[Sequence[int]]]) -> DocumentSpans:
        """Spans from a DocumentSpans or from one list of (start, end) pairs per batch row."""
        if isinstance(spans, DocumentSpans):
            return spans
        try:
            rows = tuple(tuple((int(start), int(end)) for start, end in row) for row in spans)
        except (TypeError, ValueError):
            raise TypeError(
                "Document spans are one list of (start, end) token pairs per batch row, "
                f"e.g. [[(5, 40), (41, 80)]] for one prompt; got {spans!r}."
            ) from None
        return cls(rows)

    def __len__(self) -> int:
        return len(self.rows)


def lines_with_spans(head: str, lines: Sequence[str]) -> tuple[str, list[Span]]:
    """`head` then `lines` joined by line breaks, and the character span [start, end) of each line:
    how a prompt lays out its documents, one per line, and where each one is."""
    text, spans = head, []
    for number, line in enumerate(lines):
        if number:
            text += "\n"
        spans.append((len(text), len(text) + len(line)))
        text += line
    return text, spans


def char_to_token_spans(offsets: Sequence[Sequence[int]], char_spans: Sequence[Span]) -> list[Span]:
    """Token spans covering character spans, given each token's (start, end) characters.

    A token belongs to a document when its characters overlap the document's; tokens without
    characters (special tokens) belong to none. A token shared by two documents goes to the first.
    """
    spans: list[Span] = []
    previous_end = 0
    for char_start, char_end in char_spans:
        tokens = [
            i
            for i, (start, end) in enumerate(offsets)
            if end > start and start < char_end and end > char_start and i >= previous_end
        ]
        if not tokens:
            raise ValueError(
                f"No token covers the characters [{char_start}, {char_end}); is the span inside the text?"
            )
        spans.append((tokens[0], tokens[-1] + 1))
        previous_end = tokens[-1] + 1
    return spans


def prompt_with_spans(
    tokenizer: Any, prompt: str, char_spans: Sequence[Span], *, raw: bool = False
) -> tuple[list[int], list[Span]]:
    """The token ids of `prompt` as one user turn of the chat template (`rag_mspoe.chat_template`)
    and the token span of each document, given its character span in `prompt`.

    raw=True: the prompt as plain text, without the chat template.
    """
    from rag_mspoe import chat_template

    if raw:
        text, base, special = prompt, 0, True
    else:
        text = chat_template.render_text(tokenizer, prompt)
        # The user message is the last turn the template writes.
        base, special = text.rfind(prompt), False
        if base < 0:
            raise ValueError(
                "The chat template changed the user message's text, so its document spans cannot be "
                "located; pass raw=True or spans of the rendered text."
            )
    encoded = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    shifted = [(base + start, base + end) for start, end in char_spans]
    return list(encoded["input_ids"]), char_to_token_spans(encoded["offset_mapping"], shifted)


@contextlib.contextmanager
def document_spans(
    model: Any, spans: DocumentSpans | Sequence[Sequence[Sequence[int]]]
) -> Iterator[DocumentSpans]:
    """Give the method applied to `model` the document spans of the prompts run inside the block.

    One row of spans per batch row of the prefill. Methods that do not read documents ignore them,
    so callers may always pass spans. Decoding after the prefill keeps the prefill's spans.
    """
    from rag_mspoe.rope.rescaling import STATE_ATTR

    resolved = DocumentSpans.of(spans)
    state: Any = getattr(model, STATE_ATTR, None)
    if not hasattr(state, "spans"):
        yield resolved
        return
    previous = state.spans
    state.spans = resolved
    try:
        yield resolved
    finally:
        state.spans = previous
