"""The index as a LlamaIndex retriever (needs `llama-index-core`: pip install 'rag-mspoe[llamaindex]')."""

from __future__ import annotations

from llama_index.core.callbacks import CallbackManager
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from rag_mspoe.pipelines.retrieval import DEFAULT_TOP_K, Retriever

# Bookkeeping that should not reach the LLM's prompt or a re-embedding; title and source do.
_HIDDEN_METADATA = ["location", "start", "end", "score", "rank", "chunk_id"]


class LlamaIndexRetriever(BaseRetriever):
    """Top-k chunks as LlamaIndex nodes with scores, best first."""

    def __init__(
        self, retriever: Retriever, k: int = DEFAULT_TOP_K, callback_manager: CallbackManager | None = None
    ) -> None:
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        self.retriever = retriever
        self.k = k
        super().__init__(callback_manager=callback_manager)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [
            NodeWithScore(
                node=TextNode(
                    id_=hit.uid,
                    text=hit.chunk.text,
                    metadata=hit.metadata(),
                    excluded_llm_metadata_keys=_HIDDEN_METADATA,
                    excluded_embed_metadata_keys=_HIDDEN_METADATA,
                ),
                score=hit.score,
            )
            for hit in self.retriever.retrieve(query_bundle.query_str, self.k)
        ]
