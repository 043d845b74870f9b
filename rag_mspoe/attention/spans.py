"""Document spans: where each document sits in a prompt's tokens, and how they reach a model.

Text-level code (the packer, the evaluation's prompts) knows each document's *character* span in
the user message; `prompt_with_spans` (or `rag_mspoe.prompts.document_prompts.render_with_spans` for any
prompt) renders the chat template and turns those into *token* spans of the rendered prompt. A
method that sees documents reads the spans of the prompts it runs on from
`document_spans(model, spans)`; the engine does this for every call:

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


def prompt_with_spans(
    tokenizer: Any, prompt: str, char_spans: Sequence[Span], *, raw: bool = False
) -> tuple[list[int], list[Span]]:
    """The token ids of `prompt` as one user turn of the chat template (as the engine renders it)
    and the token span of each document, given its character span in `prompt`.

    raw=True: the prompt as plain text, without the chat template.
    """
    from rag_mspoe.prompts.document_prompts import char_to_token_spans, document_message, render_with_spans

    if raw:
        encoded = tokenizer(prompt, add_special_tokens=True, return_offsets_mapping=True)
        return list(encoded["input_ids"]), char_to_token_spans(encoded["offset_mapping"], char_spans)
    ids, spans = render_with_spans(tokenizer, [document_message(prompt, char_spans)])
    return ids, spans or []


@contextlib.contextmanager
def document_spans(
    model: Any, spans: DocumentSpans | Sequence[Sequence[Sequence[int]]]
) -> Iterator[DocumentSpans]:
    """Give the method applied to `model` the document spans of the prompts run inside the block.

    One row of spans per batch row of the prefill. Methods that do not read documents ignore them,
    so callers may always pass spans. Decoding after the prefill keeps the prefill's spans. The
    first forward inside the block is the prefill of these spans even when it continues a cache:
    one filled by the unmodified model, for methods that leave the rows through the documents as
    they are (`MethodConfig.keeps_rows_through_documents`).
    """
    from rag_mspoe.rope.rescaling import STATE_ATTR

    resolved = DocumentSpans.of(spans)
    state: Any = getattr(model, STATE_ATTR, None)
    if not hasattr(state, "given_spans"):
        yield resolved
        return
    with state.given_spans(resolved):
        yield resolved
