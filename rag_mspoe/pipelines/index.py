"""A FAISS index on disk with its chunks beside it as JSON lines.

One index is a folder:

    meta.json                  settings, embedding model and dimension, which files are current
    .lock                      held by the one process that is adding to the index
    vectors-<generation>.faiss the FAISS index
    chunks-<generation>.jsonl  one chunk per line, row i of the FAISS index is line i

Every save writes new generation files, then replaces meta.json atomically: meta.json is the
commit point, so a save that is interrupted leaves the previous index whole. The previous
generation's files are removed after the commit.

meta.json also marks the folder as an index's own: the first save writes it (for an empty
index) before any other file, and a writer refuses a folder holding files the index did not
write, or index files without their meta.json, so it never deletes or overwrites a user's files.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rag_mspoe.files import LOCK_FILE, atomic_write, folder_lock
from rag_mspoe.pipelines.chunking import Chunk
from rag_mspoe.pipelines.model_fingerprint import ModelFiles

FORMAT_VERSION = 1
META_FILE = "meta.json"
INDEX_KINDS = ("flat", "hnsw", "ivf")
_GENERATION_FILE = re.compile(r"^(vectors|chunks)-\d{6,}\.(faiss|jsonl)$")
# What an interrupted atomic_write of one of the files above leaves behind.
_TEMPORARY_FILE = re.compile(r"^\.(meta\.json|(vectors|chunks)-\d{6,}\.(faiss|jsonl))\.[0-9a-f]+\.tmp$")


def writer_lock(folder: str | Path) -> contextlib.AbstractContextManager[None]:
    """Hold the index folder for one writer: two processes adding at once would each save only
    their own additions. A second writer fails at once rather than waiting unseen."""
    message = f"Another process is writing the index at {folder}; run again when it has finished"
    return folder_lock(folder, message)


class IndexNotFoundError(FileNotFoundError):
    """No index in the folder."""


class IndexMismatchError(ValueError):
    """The index was built with another embedding model or other settings than the ones asked for."""


class IndexFolderError(ValueError):
    """The folder holds files the index did not write, or an index with a missing or damaged file."""


def check_index_folder(folder: str | Path) -> None:
    """Raise IndexFolderError unless `folder` is absent, empty, or an index this package wrote.

    A lock file alone is what a killed first run leaves; it counts as empty.
    """
    path = Path(folder)
    if not path.exists():
        return
    if not path.is_dir():
        raise IndexFolderError(f"{path} is a file, not an index folder; give --index a folder name.")
    names = sorted(entry.name for entry in path.iterdir())
    if META_FILE in names:
        read_meta(path)
        foreign = [name for name in names if not _is_index_file(name)]
        if foreign:
            raise IndexFolderError(
                f"The index folder {path} holds files the index did not write ({_some(foreign)}); "
                "move them out of it, or build the index in a new folder (--index NEW_FOLDER)."
            )
        return
    index_files = [name for name in names if _GENERATION_FILE.match(name)]
    if index_files:
        raise IndexFolderError(
            f"{path / META_FILE} is missing, but {path} holds index files ({_some(index_files)}): "
            f"the index is partial or damaged. Repair it by restoring {META_FILE}, or rebuild it into a "
            "new folder with: rag-mspoe index DOCS --index NEW_FOLDER"
        )
    others = [name for name in names if name != LOCK_FILE]
    if others:
        raise IndexFolderError(
            f"{path} is not empty and is not an index ({_some(others)}); the index is written only into a "
            "new or empty folder or an index of its own: choose another --index folder."
        )


def read_meta(folder: Path) -> dict[str, Any]:
    """The parsed meta.json of the index in `folder`; a damaged file is an IndexFolderError naming it."""
    path = folder / META_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise IndexFolderError(
            f"{path} is damaged ({exc}); restore it from a backup, or rebuild the index into a new "
            "folder (--index NEW_FOLDER)."
        ) from None
    if not isinstance(raw, dict) or not {"settings", "generation", "count", "documents"} <= raw.keys():
        raise IndexFolderError(
            f"{path} is not the meta.json of an index; restore it, or rebuild the index into a new "
            "folder (--index NEW_FOLDER)."
        )
    return raw


def _is_index_file(name: str) -> bool:
    return name in (META_FILE, LOCK_FILE) or bool(_GENERATION_FILE.match(name) or _TEMPORARY_FILE.match(name))


def _some(names: list[str], shown: int = 5) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


@dataclass
class IndexSettings:
    """What an index is built with; fixed at creation and checked on every later use."""

    embedding_model: str
    dimension: int
    kind: str = "flat"
    chunk_size: int = 200
    chunk_overlap: int = 40
    hnsw_m: int = 32  # HNSW graph degree: more is more accurate, larger and slower to build
    hnsw_ef_search: int = 64  # HNSW candidates visited per query
    ivf_lists: int | None = None  # IVF cells; None picks about 4 * sqrt(chunks) at training
    ivf_probe: int = 16  # IVF cells searched per query
    # sha256 of each file of the embedding model that decides its vectors (weights, configs,
    # pooling and other modules, tokenizer), by path inside the model folder
    # (pipelines.model_fingerprint); None in indexes written before, until their next write.
    embedding_files: dict[str, str] | None = None
    # What indexes written before `embedding_files` recorded instead: one hash over the weight and
    # tokenizer files (`ModelFiles.legacy_fingerprint`), checked while it is all they hold.
    embedding_fingerprint: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in INDEX_KINDS:
            raise ValueError(f"unknown index kind '{self.kind}'; choose one of {', '.join(INDEX_KINDS)}")
        if self.dimension < 1:
            raise ValueError(f"embedding dimension must be positive, got {self.dimension}")


@dataclass
class _Meta:
    settings: IndexSettings
    generation: int = 0
    count: int = 0
    documents: dict[str, str] = field(default_factory=dict)  # document key -> sha256 of its text
    format: int = FORMAT_VERSION


class ChunkIndex:
    """Chunks and their vectors, searchable by inner product."""

    def __init__(self, path: str | Path, settings: IndexSettings) -> None:
        self.path = Path(path)
        self._meta = _Meta(settings=settings)
        self._faiss: Any = None  # built at the first add: IVF needs vectors to train on
        self._chunks: list[Chunk] = []

    @property
    def settings(self) -> IndexSettings:
        return self._meta.settings

    @property
    def documents(self) -> dict[str, str]:
        """Document key -> sha256 of the document text, for every document in the index."""
        return dict(self._meta.documents)

    def __len__(self) -> int:
        return len(self._chunks)

    def chunk(self, position: int) -> Chunk:
        return self._chunks[position]

    @staticmethod
    def exists(path: str | Path) -> bool:
        return (Path(path) / META_FILE).is_file()

    @classmethod
    def load(cls, path: str | Path) -> ChunkIndex:
        import faiss

        folder = Path(path)
        meta_path = folder / META_FILE
        if not meta_path.is_file():
            raise IndexNotFoundError(
                f"No index at {folder} ({META_FILE} is missing). "
                f"Build one with: rag-mspoe index DOCS --index {folder}"
            )
        raw = read_meta(folder)
        if raw.get("format") != FORMAT_VERSION:
            raise ValueError(
                f"The index at {folder} has format {raw.get('format')}, this version reads {FORMAT_VERSION}; "
                "rebuild the index"
            )
        index = cls(folder, IndexSettings(**raw["settings"]))
        index._meta = _Meta(
            settings=index.settings,
            generation=raw["generation"],
            count=raw["count"],
            documents=raw["documents"],
        )
        if index._meta.count:
            for kind in ("vectors", "chunks"):
                if not (folder / index._file(kind)).is_file():
                    raise IndexFolderError(
                        f"{folder / index._file(kind)} is missing, though {meta_path} lists it: the index "
                        "is damaged. Restore the file, or rebuild the index into a new folder "
                        "(--index NEW_FOLDER)."
                    )
            vectors = folder / index._file("vectors")
            try:
                index._faiss = faiss.read_index(str(vectors))
            except RuntimeError as exc:  # faiss's own C++ message: a truncated or foreign file
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else "unreadable"
                raise IndexFolderError(
                    f"{vectors} cannot be read ({reason}): the index is damaged. Restore the file, or "
                    "rebuild the index into a new folder (--index NEW_FOLDER)."
                ) from None
            index._configure_search()
            index._chunks = _read_chunks(folder / index._file("chunks"))
        found = {META_FILE: index._meta.count}
        if index._faiss is not None:
            found[index._file("chunks")] = len(index._chunks)
            found[index._file("vectors")] = index._faiss.ntotal
        if len(set(found.values())) != 1:
            counts = ", ".join(f"{name} {count}" for name, count in found.items())
            raise IndexFolderError(
                f"The index at {folder} is inconsistent: its files hold different numbers of chunks "
                f"({counts}). Restore the files, or rebuild the index into a new folder (--index NEW_FOLDER)."
            )
        if index._faiss is not None and index._faiss.d != index.settings.dimension:
            raise IndexFolderError(
                f"{folder / index._file('vectors')} holds vectors of dimension {index._faiss.d}, {meta_path} "
                f"says {index.settings.dimension}. Restore the files, or rebuild the index into a new "
                "folder (--index NEW_FOLDER)."
            )
        return index

    def check_embedding_model(self, name: str, files: ModelFiles | None = None) -> None:
        """Raise IndexMismatchError unless `name` (canonical) is the model this index was built with,
        and, where both are known, its files are the ones the index recorded."""
        if name != self.settings.embedding_model:
            raise IndexMismatchError(
                f"The index at {self.path} was built with embedding model '{self.settings.embedding_model}', "
                f"not '{name}'. Use '{self.settings.embedding_model}' (the default when you name none), "
                f"or rebuild the index into a new folder (--index NEW_FOLDER) with '{name}'."
            )
        if files is None:
            return
        recorded, legacy = self.settings.embedding_files, self.settings.embedding_fingerprint
        if recorded is not None:
            changed = "; ".join(files.changes_from(recorded))
        elif legacy is not None and files.legacy_fingerprint() != legacy:
            changed = f"its weight or tokenizer files changed (the index recorded fingerprint {legacy[:19]})"
        else:
            return
        if changed:
            raise IndexMismatchError(
                f"The embedding model at '{name}' is not the one the index at {self.path} was built "
                f"with: {changed}. Each of these changes the vectors, and vectors of two models cannot "
                "be compared. Put the original files back at that path, or rebuild the index into a "
                "new folder (--index NEW_FOLDER)."
            )

    def record_model_files(self, files: ModelFiles | None) -> None:
        """Record the embedding model's files in an index written before they were (saved with the
        next write, after `check_embedding_model` passed); an index that has them keeps them."""
        if self.settings.embedding_files is None and files is not None:
            self.settings.embedding_files = dict(files.digests)

    def add(self, chunks: Sequence[Chunk], vectors: np.ndarray, documents: dict[str, str]) -> None:
        """Append chunks with their vectors (row i belongs to chunk i) and record their documents.

        Nothing is written until `save()`.
        """
        if len(chunks) != len(vectors):
            raise ValueError(f"{len(chunks)} chunks but {len(vectors)} vectors")
        if len(chunks) == 0:
            self._meta.documents.update(documents)
            return
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[1] != self.settings.dimension:
            raise IndexMismatchError(
                f"vectors have shape {vectors.shape}, "
                f"the index at {self.path} holds dimension {self.settings.dimension}"
            )
        if self._faiss is None:
            self._faiss = self._new_faiss(vectors)
        self._faiss.add(vectors)
        self._chunks.extend(chunks)
        self._meta.documents.update(documents)
        self._meta.count = len(self._chunks)

    def search(self, queries: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
        """For each query row, up to k (chunk position, score) pairs, best first."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if self._faiss is None:
            raise ValueError(f"The index at {self.path} holds no chunks; add documents with: rag-mspoe index")
        scores, ids = self._faiss.search(np.ascontiguousarray(queries, dtype=np.float32), min(k, len(self)))
        # FAISS pads with id -1 when an approximate index finds fewer than k neighbours.
        return [
            [(int(i), float(s)) for i, s in zip(row_ids, row_scores, strict=True) if i >= 0]
            for row_ids, row_scores in zip(ids, scores, strict=True)
        ]

    def save(self) -> None:
        """Write new generation files, switch meta.json to them atomically, remove the previous ones."""
        import faiss

        self.path.mkdir(parents=True, exist_ok=True)
        meta = self._meta
        if not self.exists(self.path):
            # Mark the folder as this index's before writing anything else into it.
            self._write_meta({"generation": 0, "count": 0, "documents": {}})
        meta.generation += 1
        if self._faiss is not None:
            atomic_write(self.path / self._file("vectors"), faiss.serialize_index(self._faiss).tobytes())
            lines = "".join(json.dumps(asdict(c), ensure_ascii=False) + "\n" for c in self._chunks)
            atomic_write(self.path / self._file("chunks"), lines.encode("utf-8"))
        self._write_meta({"generation": meta.generation, "count": meta.count, "documents": meta.documents})
        # Every other generation's files go, the ones a killed save left too (the folder holds
        # only this index's own names: `check_index_folder`, under the writer's lock).
        current = {self._file("vectors"), self._file("chunks")}
        for entry in self.path.iterdir():
            stale = _GENERATION_FILE.match(entry.name) or _TEMPORARY_FILE.match(entry.name)
            if stale and entry.name not in current:
                entry.unlink(missing_ok=True)

    def _write_meta(self, state: dict[str, Any]) -> None:
        record = {"format": self._meta.format, "settings": asdict(self._meta.settings), **state}
        atomic_write(self.path / META_FILE, json.dumps(record, indent=1, ensure_ascii=False).encode("utf-8"))

    def _file(self, kind: str) -> str:
        extension = "faiss" if kind == "vectors" else "jsonl"
        return f"{kind}-{self._meta.generation:06d}.{extension}"

    def _new_faiss(self, vectors: np.ndarray) -> Any:
        import faiss

        settings = self.settings
        if settings.kind == "flat":
            return faiss.IndexFlatIP(settings.dimension)
        if settings.kind == "hnsw":
            graph = faiss.IndexHNSWFlat(settings.dimension, settings.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            graph.hnsw.efSearch = settings.hnsw_ef_search
            return graph
        lists = settings.ivf_lists or max(1, int(4 * np.sqrt(len(vectors))))
        if len(vectors) < lists:
            raise ValueError(
                f"An IVF index with {lists} cells needs at least {lists} chunks in its first batch to train, "
                f"got {len(vectors)}; use the flat index or fewer IVF cells"
            )
        settings.ivf_lists = lists
        quantizer = faiss.IndexFlatIP(settings.dimension)
        index = faiss.IndexIVFFlat(quantizer, settings.dimension, lists, faiss.METRIC_INNER_PRODUCT)
        index.train(vectors)
        index.nprobe = settings.ivf_probe
        return index

    def _configure_search(self) -> None:
        # Query-time parameters are not all serialised by FAISS; set them from our settings.
        if self.settings.kind == "hnsw":
            self._faiss.hnsw.efSearch = self.settings.hnsw_ef_search
        elif self.settings.kind == "ivf":
            self._faiss.nprobe = self.settings.ivf_probe


def _read_chunks(path: Path) -> list[Chunk]:
    chunks = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                chunks.append(Chunk(**json.loads(line)))
            except (json.JSONDecodeError, TypeError) as exc:
                raise IndexFolderError(
                    f"{path}, line {number}: not a chunk record ({exc}); the index is damaged. "
                    "Restore the file, or rebuild the index into a new folder (--index NEW_FOLDER)."
                ) from None
    return chunks
