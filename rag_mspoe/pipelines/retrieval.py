"""Top-k retrieval over a saved index with the embedding model it was built with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rag_mspoe.pipelines.chunking import Chunk
from rag_mspoe.pipelines.embedding import Embedder, canonical_model_name
from rag_mspoe.pipelines.index import ChunkIndex

DEFAULT_TOP_K = 5


@dataclass(frozen=True)
class RetrievedChunk:
    chunk: Chunk
    score: float  # cosine similarity to the query
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
    """Embeds a query and returns the closest chunks, best first."""

    def __init__(self, index: ChunkIndex, embedder: Embedder) -> None:
        index.check_embedding_model(embedder.name, embedder.files)
        self.index = index
        self.embedder = embedder

    @classmethod
    def load(
        cls, index_dir: str | Path, *, embedding_model: str | None = None, device: str = "cpu"
    ) -> Retriever:
        """Open the index in `index_dir` with the embedding model recorded in it.

        Naming another `embedding_model` raises IndexMismatchError before anything is loaded.
        """
        index = ChunkIndex.load(index_dir)
        if embedding_model is not None:
            index.check_embedding_model(canonical_model_name(embedding_model))
        return cls(index, Embedder.load(index.settings.embedding_model, device=device))

    def retrieve(self, query: str, k: int = DEFAULT_TOP_K) -> list[RetrievedChunk]:
        return self.retrieve_many([query], k)[0]

    def retrieve_many(self, queries: list[str], k: int = DEFAULT_TOP_K) -> list[list[RetrievedChunk]]:
        hits = self.index.search(self.embedder.embed_queries(queries), k)
        return [
            [
                RetrievedChunk(chunk=self.index.chunk(position), score=score, rank=rank, chunk_id=position)
                for rank, (position, score) in enumerate(row, start=1)
            ]
            for row in hits
        ]
