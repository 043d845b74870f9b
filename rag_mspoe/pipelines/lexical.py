"""BM25 over an index's chunks, and reciprocal-rank fusion of two rankings.

Dense retrieval misses exact names, numbers and rare words that a question shares with its
answer's passage; BM25 finds them. Fusing both rankings by reciprocal rank (Cormack et al., 2009)
needs no score calibration between them and puts first the chunks both rank high.

The BM25 index is built in memory from the chunks' titles and texts when first asked for (bm25s,
seconds for a million short chunks), so an index folder needs nothing more on disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rag_mspoe.pipelines.chunking import Chunk

# The constant of reciprocal-rank fusion: 60 in the paper that introduced it and in most libraries.
RRF_K = 60


class LexicalIndex:
    """BM25 (Lucene's variant, English stop words) over chunks, searchable like the dense index."""

    def __init__(self, chunks: Sequence[Chunk]) -> None:
        try:
            import bm25s
            from bm25s.tokenization import Tokenizer
        except ImportError as exc:
            raise ImportError(
                f"{exc}. Lexical and hybrid retrieval need bm25s: pip install 'rag-mspoe[rag]'"
            ) from exc
        self._tokenizer = Tokenizer(stopwords="en")
        texts = [f"{chunk.title}\n{chunk.text}" for chunk in chunks]
        ids = self._tokenizer.tokenize(texts, return_as="ids", show_progress=False)
        self._bm25: Any = bm25s.BM25()
        self._bm25.index(ids, show_progress=False)
        self._count = len(texts)

    def search(self, queries: Sequence[str], k: int) -> list[list[tuple[int, float]]]:
        """For each query, up to k (chunk position, BM25 score) pairs, best first; chunks that
        share no word with the query are left out."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if self._count == 0:
            return [[] for _ in queries]
        tokens = self._tokenizer.tokenize(
            list(queries), return_as="ids", update_vocab=False, show_progress=False
        )
        positions, scores = self._bm25.retrieve(tokens, k=min(k, self._count), show_progress=False)
        return [
            [(int(where), float(score)) for where, score in zip(row, row_scores, strict=True) if score > 0]
            for row, row_scores in zip(positions, scores, strict=True)
        ]


def reciprocal_rank_fusion(rankings: Sequence[Sequence[int]], k: int) -> list[tuple[int, float]]:
    """Up to k (item, fused score) pairs, best first: each item scores the sum of 1 / (RRF_K + rank)
    over the rankings that hold it. Ties keep the order of first appearance (the first ranking's)."""
    fused: dict[int, float] = {}
    for ranking in rankings:
        for rank, item in enumerate(ranking, start=1):
            fused[item] = fused.get(item, 0.0) + 1.0 / (RRF_K + rank)
    ordered = sorted(fused.items(), key=lambda pair: -pair[1])
    return ordered[:k]
