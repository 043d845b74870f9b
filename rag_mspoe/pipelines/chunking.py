"""Split documents into overlapping windows of embedding-model tokens.

Windows are counted in the embedding model's own tokens, so a chunk never exceeds what the
model reads (anything longer would be cut silently when embedded). Each chunk keeps character
offsets into its document's text, taken from the tokenizer's offset mapping, so a citation can
point at the exact span.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from rag_mspoe.pipelines.ingest import Document, document_key
from rag_mspoe.progress import tqdm_disable

DEFAULT_CHUNK_SIZE = 200
DEFAULT_CHUNK_OVERLAP = 40
_TOKENIZE_BATCH = 64


@dataclass(frozen=True)
class Chunk:
    """A span of one document: `text == document.text[start:end]`.

    Not the same record as `ingest.Document` on purpose: the index stores chunks only (a
    document's text would be stored again in each of its chunks), so a chunk carries its
    document's identity (source, title, location: the same `document_key`) plus its offsets, and
    a document has no offsets to carry. Packing (`pipelines.packing`) makes the prompt's
    documents of retrieved chunks.
    """

    source: str
    title: str
    text: str
    start: int
    end: int
    location: str | None = None

    @property
    def document_key(self) -> str:
        return document_key(self.source, self.location)


def check_chunking(chunk_size: int, overlap: int, max_tokens: int | None = None) -> None:
    """Raise ValueError for settings that would loop forever or overflow the embedding model."""
    if chunk_size < 1:
        raise ValueError(f"chunk size must be at least 1 token, got {chunk_size}")
    if not 0 <= overlap < chunk_size:
        raise ValueError(
            f"chunk overlap must be between 0 and chunk size - 1 ({chunk_size - 1}), got {overlap}"
        )
    if max_tokens is not None and chunk_size > max_tokens:
        raise ValueError(
            f"chunk size {chunk_size} exceeds the {max_tokens} tokens the embedding model reads; "
            f"use a chunk size of at most {max_tokens}"
        )


def chunk_documents(
    documents: Sequence[Document],
    tokenizer: Any,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    overlap: int = DEFAULT_CHUNK_OVERLAP,
    progress: bool | None = None,
) -> list[Chunk]:
    """Cut each document into windows of `chunk_size` tokens that share `overlap` tokens.

    `tokenizer` is a fast Hugging Face tokenizer (it must report character offsets).
    """
    check_chunking(chunk_size, overlap)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("chunking needs a fast tokenizer (one that reports character offsets)")
    chunks: list[Chunk] = []
    with tqdm(total=len(documents), desc="Chunking", unit="doc", disable=tqdm_disable(progress)) as bar:
        for first in range(0, len(documents), _TOKENIZE_BATCH):
            batch = documents[first : first + _TOKENIZE_BATCH]
            encoded = tokenizer(
                [doc.text for doc in batch],
                add_special_tokens=False,
                return_offsets_mapping=True,
                verbose=False,  # documents are longer than the model limit on purpose; we cut them here
            )
            for doc, offsets in zip(batch, encoded["offset_mapping"], strict=True):
                chunks.extend(_windows(doc, offsets, chunk_size, overlap))
            bar.update(len(batch))
    return chunks


def _windows(doc: Document, offsets: Sequence[tuple[int, int]], size: int, overlap: int) -> list[Chunk]:
    windows = []
    start = 0
    while start < len(offsets):
        end = min(start + size, len(offsets))
        char_start, char_end = offsets[start][0], offsets[end - 1][1]
        windows.append(
            Chunk(
                source=doc.source,
                title=doc.title,
                text=doc.text[char_start:char_end],
                start=char_start,
                end=char_end,
                location=doc.location,
            )
        )
        if end == len(offsets):
            break
        start = end - overlap
    return windows
