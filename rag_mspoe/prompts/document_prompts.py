"""Prompts that say where their documents are, and the token spans of those documents.

Attention-level methods (`rag_mspoe.attention`) need to know which tokens belong to which
document. A prompt tells them in one of two ways:

- explicitly: a message carries `"document_spans"`, the character range [start, end) of each
  document in its `content` (`document_message(text, spans)` builds one; the packer's
  `PackedPrompt.message` and the evaluation's prompts do);
- by its layout: lines that start `Document [1]`, `Document [2]`, ... (the format the packer and
  the lost-in-the-middle benchmark write) are found in the messages' text, one document a line.
  So a LangChain or LlamaIndex chain, or an HTTP client, that formats its documents that way
  needs nothing else.

`render_with_spans` renders a prompt as the engine does (`rag_mspoe.prompts.chat_template.render`,
same token ids) and turns those character spans into token spans of the rendered prompt.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from rag_mspoe.prompts.chat_template import (
    DOCUMENT_SPANS,
    Prompt,
    PromptError,
    as_messages,
    raw_text,
    render_text,
)
from rag_mspoe.prompts.template_encoding import SpecialTextMask

Span = tuple[int, int]

# A document line of the packer's and the benchmark's layout: "Document [3](Title: ...) text".
_DOCUMENT_LINE = re.compile(r"^Document \[(\d+)\][^\n]*", re.MULTILINE)

# The reorderings rank the documents by the text after them, the question in the prompts they were
# validated on; "Answer:" alone is too little to rank by (measured: the shipped 0.5B ranking then
# moves the last document first).
MIN_QUESTION_CHARS = 24

HOW_TO_PASS_SPANS = (
    "Write each document on its own line starting 'Document [1]', 'Document [2]', ... (as "
    "rag_mspoe.pipelines.packing and rag_mspoe.connectors.format_documents do), or pass the "
    "documents' character spans with the message: {'role': 'user', 'content': text, "
    "'document_spans': [[start, end], ...]} (rag_mspoe.prompts.document_prompts.document_message); "
    "'document_spans': [] says the prompt has no documents."
)


class MissingDocumentSpans(PromptError):
    """A method needs to know where the documents are, and the prompt does not say."""

    @classmethod
    def of(cls, method_name: str) -> MissingDocumentSpans:
        return cls(
            f"{method_name} needs to know where each document is in the prompt, and this prompt does "
            f"not say. {HOW_TO_PASS_SPANS}"
        )


def document_message(text: str, spans: Sequence[Sequence[int]], role: str = "user") -> dict[str, Any]:
    """A message whose documents sit at the character ranges `spans` of `text`."""
    return {"role": role, "content": text, DOCUMENT_SPANS: [[int(start), int(end)] for start, end in spans]}


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


def find_document_lines(text: str) -> list[Span] | None:
    """The character span of each 'Document [i]' line of `text`, numbered 1, 2, ... in order;
    None when there are none or their numbers do not run 1, 2, 3, ..."""
    matches = list(_DOCUMENT_LINE.finditer(text))
    if not matches or [int(m.group(1)) for m in matches] != list(range(1, len(matches) + 1)):
        return None
    return [(m.start(), m.end()) for m in matches]


def render_with_spans(
    tokenizer: Any,
    prompt: Prompt,
    *,
    raw: bool = False,
    prefix: str = "",
    tools: Sequence[Mapping[str, Any]] = (),
) -> tuple[list[int], list[Span] | None]:
    """The token ids `chat_template.render` gives, and the token span of every document, in
    order; None when the prompt does not say where its documents are (an explicit empty list of
    spans gives [])."""
    if raw:
        text = raw_text(prompt, tools)
        encoded = tokenizer(text + prefix, add_special_tokens=True, return_offsets_mapping=True)
        lines = _message_spans(as_messages(prompt)[0])  # explicit spans, else document lines
        token_spans = None if lines is None else char_to_token_spans(encoded["offset_mapping"], lines)
        return list(encoded["input_ids"]), token_spans
    messages = as_messages(prompt)
    found = [_message_spans(message) for message in messages]
    mask = SpecialTextMask(tokenizer)
    rendered = render_text(tokenizer, messages, tools=tools, untrusted=mask.value)
    ids, offsets = mask.encode_with_offsets(rendered + mask.text(prefix))
    if all(spans is None for spans in found):
        return ids, None
    char_spans: list[Span] = []
    cursor = 0
    for message, spans in zip(messages, found, strict=True):
        if spans is None:
            continue
        original = message["content"]
        base = _located(rendered, mask.text(original), cursor)
        cursor = base + len(mask.text(original).strip())
        for start, end in spans:
            # Offsets in the masked text, where special tokens' texts are placeholders.
            masked_start = base + len(mask.text(original[:start]))
            char_spans.append((masked_start, masked_start + len(mask.text(original[start:end]))))
    return ids, char_to_token_spans(offsets, char_spans)


def _located(rendered: str, content: str, cursor: int) -> int:
    """Where `content` starts in the rendered prompt (templates that trim messages included)."""
    base = rendered.find(content, cursor)
    if base >= 0:
        return base
    trimmed = content.strip()
    base = rendered.find(trimmed, cursor) if trimmed else -1
    if base < 0:
        raise PromptError(
            "The chat template changed the text of a message with documents, so where its "
            "documents are cannot be found; pass raw=True with the template applied yourself."
        )
    return base - (len(content) - len(content.lstrip()))  # offsets count the untrimmed text


def _message_spans(message: Mapping[str, Any]) -> list[Span] | None:
    explicit = message.get(DOCUMENT_SPANS)
    if explicit is not None:
        return [(int(start), int(end)) for start, end in explicit]
    if message.get("role") in ("user", "system") and isinstance(message.get("content"), str):
        return find_document_lines(message["content"])
    return None


def text_after_documents(prompt: Prompt) -> str | None:
    """What a prompt says after its last document: the rest of that message, then every later
    message's content; None when it does not say where its documents are or holds none."""
    messages = as_messages(prompt)
    marked = [(index, spans) for index, message in enumerate(messages) if (spans := _message_spans(message))]
    if not marked:
        return None
    last, spans = marked[-1]
    after = str(messages[last]["content"])[spans[-1][1] :]
    return after + "".join(str(message.get("content") or "") for message in messages[last + 1 :])


def question_follows_documents(prompt: Prompt) -> bool:
    """Whether a question's worth of text follows the prompt's last document (True when it marks
    none): the reorderings rank documents by what follows them."""
    after = text_after_documents(prompt)
    return after is None or len(after.strip()) >= MIN_QUESTION_CHARS


def char_to_token_spans(offsets: Sequence[Sequence[int]], char_spans: Sequence[Span]) -> list[Span]:
    """Token spans covering character spans, given each token's (start, end) characters.

    A token belongs to a document when its characters overlap the document's; tokens without
    characters (special tokens) belong to none. A token shared by two documents goes to the first.
    """
    spans: list[Span] = []
    token = 0
    for char_start, char_end in char_spans:
        while token < len(offsets) and not _overlaps(offsets[token], char_start, char_end):
            token += 1
        first = token
        while token < len(offsets) and (
            _overlaps(offsets[token], char_start, char_end) or offsets[token][1] <= offsets[token][0]
        ):
            token += 1
        last = token
        while last > first and not _overlaps(offsets[last - 1], char_start, char_end):
            last -= 1  # special tokens after the document's last token are not its own
        if last == first:
            raise PromptError(
                f"No token covers the characters [{char_start}, {char_end}); is the span inside the text?"
            )
        spans.append((first, last))
    return spans


def _overlaps(offset: Sequence[int], char_start: int, char_end: int) -> bool:
    start, end = offset
    return end > start and start < char_end and end > char_start
