"""Build or extend an index: read files, chunk, embed, add to FAISS, save.

The index is saved after every `checkpoint_chunks` chunks (at document boundaries), so an
interrupted run keeps what it embedded; running it again skips documents already indexed and
carries on with the rest. The index writes only into a new or empty folder or one of its own
indexes, and never reads its own folder as documents.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from rag_mspoe.files import LOCK_FILE
from rag_mspoe.pipelines.chunking import (
    DEFAULT_CHUNK_OVERLAP,
    DEFAULT_CHUNK_SIZE,
    Chunk,
    check_chunking,
    chunk_documents,
)
from rag_mspoe.pipelines.embedding import DEFAULT_EMBEDDING_MODEL, Embedder, canonical_model_name
from rag_mspoe.pipelines.index import (
    ChunkIndex,
    IndexMismatchError,
    IndexSettings,
    check_index_folder,
    writer_lock,
)
from rag_mspoe.pipelines.ingest import Document, Skipped, load_documents
from rag_mspoe.progress import tqdm_disable

logger = logging.getLogger(__name__)

DEFAULT_CHECKPOINT_CHUNKS = 5000
# Special tokens the embedding model adds around each text ([CLS] and [SEP] for BERT models).
_SPECIAL_TOKENS = 2


@dataclass
class IndexReport:
    index_dir: Path
    documents_added: int = 0
    chunks_added: int = 0
    unchanged: int = 0  # documents already in the index with the same text
    skipped: list[Skipped] = field(default_factory=list)
    total_chunks: int = 0
    embed_seconds: float = 0.0
    seconds: float = 0.0

    def summary(self) -> str:
        text = (
            f"Indexed {self.documents_added} documents as {self.chunks_added} chunks into {self.index_dir} "
            f"({self.total_chunks} chunks in all) in {self.seconds:.1f} s"
        )
        if self.embed_seconds > 0:
            text += f"; embedding ran at {self.chunks_added / self.embed_seconds:.0f} chunks/s"
        if self.unchanged:
            text += f"; {self.unchanged} documents were already indexed"
        if self.skipped:
            text += f"; {len(self.skipped)} skipped"
        return text


def embedding_text(chunk: Chunk) -> str:
    """What gets embedded for a chunk: its title helps retrieval when the chunk text never names it."""
    return f"{chunk.title}\n{chunk.text}" if chunk.title else chunk.text


def index_documents(
    paths: str | Path | Sequence[str | Path],
    index_dir: str | Path,
    *,
    embedding_model: str | None = None,
    chunk_size: int | None = None,
    chunk_overlap: int | None = None,
    kind: str | None = None,
    text_field: str = "text",
    batch_size: int = 64,
    checkpoint_chunks: int = DEFAULT_CHECKPOINT_CHUNKS,
    embedder: Embedder | None = None,
    progress: bool | None = None,
    follow_outside_links: bool = False,
) -> IndexReport:
    """Index the files under `paths` into `index_dir`, creating the index or adding to it.

    Settings left as None take the existing index's values, or the defaults for a new index;
    a setting that contradicts an existing index raises IndexMismatchError. Links inside a
    folder to files outside it are skipped unless `follow_outside_links`.
    """
    started = time.perf_counter()
    folder = Path(index_dir)
    report = IndexReport(index_dir=folder)
    check_index_folder(folder)
    ingested = load_documents(
        paths,
        text_field=text_field,
        progress=progress,
        exclude=[folder],
        follow_outside_links=follow_outside_links,
    )
    report.skipped.extend(ingested.skipped)

    if not ingested.documents and not ChunkIndex.exists(folder):
        raise ValueError(
            f"No readable documents in {_describe(paths)}: {ingested.summary()}; nothing to index"
        )

    folder_was_there, lock_was_there = folder.exists(), (folder / LOCK_FILE).exists()
    with writer_lock(folder):
        try:
            index, embedder = _open_or_create(
                folder, embedder, embedding_model, chunk_size, chunk_overlap, kind
            )
            new_documents = _new_documents(ingested.documents, index.documents, report)
            _embed_and_save(index, embedder, new_documents, report, batch_size, checkpoint_chunks, progress)
        except BaseException:
            # Nothing saved: leave no folder holding only a lock. Tidied while the lock is held, so
            # no other writer can have locked the file being removed.
            if not ChunkIndex.exists(folder):
                with contextlib.suppress(OSError):  # best effort; the run's own error is what matters
                    if not lock_was_there:
                        (folder / LOCK_FILE).unlink()
                    if not folder_was_there and not any(folder.iterdir()):
                        folder.rmdir()
            raise
    report.total_chunks = len(index)
    report.seconds = time.perf_counter() - started
    return report


def _open_or_create(
    index_dir: str | Path,
    embedder: Embedder | None,
    embedding_model: str | None,
    chunk_size: int | None,
    chunk_overlap: int | None,
    kind: str | None,
) -> tuple[ChunkIndex, Embedder]:
    if ChunkIndex.exists(index_dir):
        index = ChunkIndex.load(index_dir)
        _check_same_settings(index, embedding_model, chunk_size, chunk_overlap, kind)
        embedder = embedder or Embedder.load(index.settings.embedding_model)
        index.check_embedding_model(embedder.name, embedder.files)
        index.record_model_files(embedder.files)
    else:
        embedder = embedder or Embedder.load(embedding_model or DEFAULT_EMBEDDING_MODEL)
        if embedding_model is not None and canonical_model_name(embedding_model) != embedder.name:
            raise ValueError(
                f"embedding_model '{embedding_model}' differs from the embedder given ({embedder.name})"
            )
        index = ChunkIndex(
            index_dir,
            IndexSettings(
                embedding_model=embedder.name,
                dimension=embedder.dimension,
                embedding_files=None if embedder.files is None else embedder.files.digests,
                kind=kind or "flat",
                chunk_size=DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size,
                chunk_overlap=DEFAULT_CHUNK_OVERLAP if chunk_overlap is None else chunk_overlap,
            ),
        )
    check_chunking(
        index.settings.chunk_size, index.settings.chunk_overlap, embedder.max_tokens - _SPECIAL_TOKENS
    )
    return index, embedder


def _embed_and_save(
    index: ChunkIndex,
    embedder: Embedder,
    documents: list[Document],
    report: IndexReport,
    batch_size: int,
    checkpoint_chunks: int,
    progress: bool | None,
) -> None:
    settings = index.settings
    chunks = chunk_documents(
        documents,
        embedder.tokenizer,
        chunk_size=settings.chunk_size,
        overlap=settings.chunk_overlap,
        progress=progress,
    )
    chunked = {chunk.document_key for chunk in chunks}
    for doc in documents:
        if doc.key not in chunked:  # e.g. only control characters: the embedding model reads nothing
            report.skipped.append(Skipped(doc.key, "no text the embedding model can read"))
    documents = [doc for doc in documents if doc.key in chunked]
    report.documents_added = len(documents)
    with tqdm(total=len(chunks), desc="Embedding", unit="chunk", disable=tqdm_disable(progress)) as bar:
        for group, hashes in _checkpoint_groups(chunks, documents, checkpoint_chunks):
            embed_started = time.perf_counter()
            vectors = embedder.embed(
                [embedding_text(c) for c in group], batch_size=batch_size, on_batch=bar.update
            )
            report.embed_seconds += time.perf_counter() - embed_started
            index.add(group, vectors, hashes)
            index.save()
            report.chunks_added += len(group)


def _check_same_settings(
    index: ChunkIndex,
    embedding_model: str | None,
    chunk_size: int | None,
    overlap: int | None,
    kind: str | None,
) -> None:
    if embedding_model is not None:
        index.check_embedding_model(canonical_model_name(embedding_model))
    asked = {"chunk size": chunk_size, "chunk overlap": overlap, "index kind": kind}
    built = {
        "chunk size": index.settings.chunk_size,
        "chunk overlap": index.settings.chunk_overlap,
        "index kind": index.settings.kind,
    }
    for name, value in asked.items():
        if value is not None and value != built[name]:
            raise IndexMismatchError(
                f"The index at {index.path} was built with {name} {built[name]}, not {value}; "
                f"leave it out to add with the index's own setting, or build a new index"
            )


def _new_documents(documents: list[Document], indexed: dict[str, str], report: IndexReport) -> list[Document]:
    """Documents not yet in the index; a changed document is skipped (an index only grows)."""
    fresh: list[Document] = []
    seen: set[str] = set()
    for doc in documents:
        digest = _digest(doc.text)
        if doc.key in seen:
            report.skipped.append(Skipped(doc.key, "given twice; indexed once"))
            continue
        seen.add(doc.key)
        if doc.key not in indexed:
            fresh.append(doc)
        elif indexed[doc.key] == digest:
            report.unchanged += 1
        else:
            reason = "already indexed with different text; build a new index to replace it"
            logger.warning("Skipping %s: %s", doc.key, reason)
            report.skipped.append(Skipped(doc.key, reason))
    return fresh


def _checkpoint_groups(chunks: list[Chunk], documents: list[Document], size: int):
    """Yield (chunks, {document key: digest}) groups of whole documents, about `size` chunks each."""
    by_document: dict[str, list[Chunk]] = {}
    for chunk in chunks:
        by_document.setdefault(chunk.document_key, []).append(chunk)
    group: list[Chunk] = []
    hashes: dict[str, str] = {}
    for doc in documents:
        group.extend(by_document.get(doc.key, []))
        hashes[doc.key] = _digest(doc.text)
        if len(group) >= size:
            yield group, hashes
            group, hashes = [], {}
    if hashes:
        yield group, hashes


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _describe(paths: str | Path | Sequence[str | Path]) -> str:
    return str(paths) if isinstance(paths, str | Path) else ", ".join(str(p) for p in paths)
