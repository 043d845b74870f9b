"""Lexical (BM25) and hybrid (reciprocal-rank fusion) first stages over a real index."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pipelines_helpers import QUESTIONS, embedder, write_corpus

from rag_mspoe.cli import main
from rag_mspoe.connectors.retrievers import langchain_retriever
from rag_mspoe.pipelines.index import ChunkIndex
from rag_mspoe.pipelines.indexing import index_documents
from rag_mspoe.pipelines.lexical import RRF_K, reciprocal_rank_fusion
from rag_mspoe.pipelines.retrieval import Retriever

# A part number no embedding model tokenises into anything meaningful, in one chunk only.
PART_NUMBER_DOC = {"parts.txt": "Replacement valve for the Orrin boiler: order part QX7731B from the yard.\n"}


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("first-stage")
    docs = write_corpus(folder / "docs")
    write_corpus(docs, PART_NUMBER_DOC)
    index_documents(docs, folder / "index", embedder=embedder(), progress=False)
    return folder / "index"


def _retriever(index_dir: Path, first_stage: str) -> Retriever:
    return Retriever(ChunkIndex.load(index_dir), embedder(), first_stage=first_stage)  # type: ignore[arg-type]


def test_lexical_ranks_the_chunk_sharing_a_rare_word_first_and_skips_chunks_sharing_none(index_dir):
    hits = _retriever(index_dir, "lexical").retrieve("QX7731B", 5)
    assert [Path(hit.chunk.source).name for hit in hits] == ["parts.txt"]
    assert hits[0].rank == 1 and hits[0].score > 0
    assert _retriever(index_dir, "lexical").retrieve("zzzz qqqq", 5) == []


@pytest.mark.parametrize("first_stage", ["lexical", "hybrid"])
def test_each_first_stage_finds_the_answering_file_first(index_dir, first_stage):
    retriever = _retriever(index_dir, first_stage)
    for question, source in QUESTIONS.items():
        hits = retriever.retrieve(question, 3)
        assert Path(hits[0].chunk.source).name == source, question
        assert [hit.rank for hit in hits] == list(range(1, len(hits) + 1))
        assert [hit.score for hit in hits] == sorted((hit.score for hit in hits), reverse=True)


def test_hybrid_scores_are_the_reciprocal_ranks_of_both_stages(index_dir):
    question = "Who dredged the harbour of Vossel?"
    dense = _retriever(index_dir, "dense")
    lexical = _retriever(index_dir, "lexical")
    ranks = {
        name: {hit.chunk_id: hit.rank for hit in r.retrieve(question, 50)}
        for name, r in (("dense", dense), ("lexical", lexical))
    }
    for hit in _retriever(index_dir, "hybrid").retrieve(question, 6):
        expected = sum(1 / (RRF_K + found[hit.chunk_id]) for found in ranks.values() if hit.chunk_id in found)
        assert hit.score == pytest.approx(expected)


def test_fusion_prefers_an_item_both_rank_second_to_one_only_one_ranks_first():
    fused = reciprocal_rank_fusion([[1, 2], [3, 2]], 3)
    assert [item for item, _ in fused] == [2, 1, 3]  # 1 and 3 tie: the first ranking's comes first
    assert fused[0][1] == pytest.approx(2 / (RRF_K + 2))
    assert reciprocal_rank_fusion([[1, 2, 3]], 2) == [(1, 1 / (RRF_K + 1)), (2, 1 / (RRF_K + 2))]


def test_an_unknown_first_stage_is_named_with_the_choices(index_dir):
    with pytest.raises(ValueError, match="first_stage must be one of dense, lexical, hybrid, got 'sparse'"):
        _retriever(index_dir, "sparse")


def test_langchain_retriever_takes_the_first_stage(index_dir):
    pytest.importorskip("langchain_core")
    dense = _retriever(index_dir, "dense")
    documents = langchain_retriever(dense, k=5, first_stage="lexical").invoke("QX7731B")
    assert [Path(d.metadata["source"]).name for d in documents] == ["parts.txt"]
    assert langchain_retriever(dense, k=5).retriever is dense  # an open retriever keeps its own stage


def test_search_command_takes_the_first_stage(index_dir, capsys):
    assert main(["search", "QX7731B", "--index", str(index_dir), "--first-stage", "lexical", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert [Path(hit["source"]).name for hit in hits] == ["parts.txt"]
