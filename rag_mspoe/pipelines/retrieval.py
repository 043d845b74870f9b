"""Top-k retrieval over a saved index: dense (the embedding model it was built with), lexical
(BM25 over its chunks) or hybrid (both, fused by reciprocal rank)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from rag_mspoe.pipelines.chunking import Chunk
from rag_mspoe.pipelines.embedding import Embedder, canonical_model_name
from rag_mspoe.pipelines.index import ChunkIndex
from rag_mspoe.pipelines.lexical import LexicalIndex, reciprocal_rank_fusion

DEFAULT_TOP_K = 5
FirstStage = Literal["dense", "lexical", "hybrid"]
FIRST_STAGES: tuple[str, ...] = get_args(FirstStage)
# Hybrid retrieval fuses this many of each stage's best chunks per chunk asked for (at least
# HYBRID_MIN_POOL), so a chunk ranked low by one stage and high by the other can still win.
HYBRID_POOL_FACTOR = 4
HYBRID_MIN_POOL = 50


@dataclass(frozen=True)
class RetrievedChunk:
    chunk: Chunk
    score: float  # dense: cosine similarity to the query; lexical: BM25; hybrid: fused reciprocal rank
    rank: int  # 1 for the best match
    chunk_id: int  # row of the chunk in the index

    @property
    def uid(self) -> str:
        """A readable id, unique across indexes: source, location and character span."""
        chunk = self.chunk
        where = f"#{chunk.location}" if chunk.location else ""
        return f"{chunk.source}{where}:{chunk.start}-{chunk.end}"

    def metadata(self) -> dict[str, Any]:
        """Where the chunk comes from and how it ranked, for LangChain and LlamaIndex documents."""
        chunk = self.chunk
        return {
            "source": chunk.source,
            "title": chunk.title,
            "location": chunk.location,
            "start": chunk.start,
            "end": chunk.end,
            "score": self.score,
            "rank": self.rank,
            "chunk_id": self.chunk_id,
        }


class Retriever:
    """Returns the chunks closest to a query, best first: by embedding (`dense`, the default), by
    BM25 (`lexical`) or by both fused (`hybrid`)."""

    def __init__(self, index: ChunkIndex, embedder: Embedder, *, first_stage: FirstStage = "dense") -> None:
        if first_stage not in FIRST_STAGES:
            raise ValueError(f"first_stage must be one of {', '.join(FIRST_STAGES)}, got {first_stage!r}")
        index.check_embedding_model(embedder.name, embedder.files)
        self.index = index
        self.embedder = embedder
        self.first_stage = first_stage
        self._lexical: LexicalIndex | None = None
        self._lexical_built = threading.Lock()  # a server's concurrent first queries build it once

    @classmethod
    def load(
        cls,
        index_dir: str | Path,
        *,
        embedding_model: str | None = None,
        device: str = "cpu",
        first_stage: FirstStage = "dense",
    ) -> Retriever:
        """Open the index in `index_dir` with the embedding model recorded in it.

        Naming another `embedding_model` raises IndexMismatchError before anything is loaded.
        """
        index = ChunkIndex.load(index_dir)
        if embedding_model is not None:
            index.check_embedding_model(canonical_model_name(embedding_model))
        embedder = Embedder.load(index.settings.embedding_model, device=device)
        return cls(index, embedder, first_stage=first_stage)

    def retrieve(self, query: str, k: int = DEFAULT_TOP_K) -> list[RetrievedChunk]:
        return self.retrieve_many([query], k)[0]

    def retrieve_many(self, queries: list[str], k: int = DEFAULT_TOP_K) -> list[list[RetrievedChunk]]:
        if self.first_stage == "dense":
            hits = self.dense(queries, k)
        elif self.first_stage == "lexical":
            hits = self.lexical(queries, k)
        else:
            pool = max(HYBRID_POOL_FACTOR * k, HYBRID_MIN_POOL)
            hits = [
                reciprocal_rank_fusion([[p for p, _ in dense], [p for p, _ in lexical]], k)
                for dense, lexical in zip(self.dense(queries, pool), self.lexical(queries, pool), strict=True)
            ]
        return [
            [
                RetrievedChunk(chunk=self.index.chunk(position), score=score, rank=rank, chunk_id=position)
                for rank, (position, score) in enumerate(row, start=1)
            ]
            for row in hits
        ]

    def dense(self, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
        """(chunk position, cosine similarity) pairs by embedding, best first."""
        return self.index.search(self.embedder.embed_queries(queries), k)

    def lexical(self, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
        """(chunk position, BM25 score) pairs, best first (the BM25 index is built at first use)."""
        with self._lexical_built:
            if self._lexical is None:
                self._lexical = LexicalIndex([self.index.chunk(i) for i in range(len(self.index))])
        return self._lexical.search(queries, k)
