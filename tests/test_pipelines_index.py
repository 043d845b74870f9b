"""The FAISS index on disk: build, retrieve, reload, add, approximate kinds, mismatches, atomic saves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pipelines_helpers import QUESTIONS, embedder, write_corpus

from rag_mspoe.pipelines.index import ChunkIndex, IndexMismatchError, IndexNotFoundError
from rag_mspoe.pipelines.indexing import index_documents
from rag_mspoe.pipelines.retrieval import Retriever


def _build(tmp_path: Path, **options):
    docs = write_corpus(tmp_path / "docs")
    index_dir = tmp_path / "index"
    report = index_documents(docs, index_dir, embedder=embedder(), progress=False, **options)
    return docs, index_dir, report


def _top_files(retriever: Retriever, question: str, k: int = 3) -> list[str]:
    return [Path(hit.chunk.source).name for hit in retriever.retrieve(question, k)]


def test_build_then_load_retrieves_the_right_file_with_scores_best_first(tmp_path):
    _, index_dir, report = _build(tmp_path)
    assert (report.documents_added, report.chunks_added, report.total_chunks) == (5, 5, 5)

    meta = json.loads((index_dir / "meta.json").read_text())
    assert meta["settings"]["embedding_model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert meta["settings"]["dimension"] == 384
    assert not list(index_dir.glob("*.pkl")) and not list(index_dir.glob("*.pickle"))

    retriever = Retriever(ChunkIndex.load(index_dir), embedder())
    for question, source in QUESTIONS.items():
        hits = retriever.retrieve(question, 4)
        assert Path(hits[0].chunk.source).name == source, question
        assert [hit.rank for hit in hits] == [1, 2, 3, 4]
        assert [hit.score for hit in hits] == sorted((hit.score for hit in hits), reverse=True)
        assert hits[0].chunk.text in Path(hits[0].chunk.source).read_text() or source.endswith(".html")


def test_reload_returns_identical_results(tmp_path):
    _, index_dir, _ = _build(tmp_path)
    first = Retriever(ChunkIndex.load(index_dir), embedder())
    questions = list(QUESTIONS)
    before = [[(h.chunk, round(h.score, 5)) for h in row] for row in first.retrieve_many(questions, 5)]
    again = Retriever(ChunkIndex.load(index_dir), embedder())
    after = [[(h.chunk, round(h.score, 5)) for h in row] for row in again.retrieve_many(questions, 5)]
    assert before == after


def test_adding_documents_to_an_existing_index(tmp_path):
    docs, index_dir, _ = _build(tmp_path)
    write_corpus(docs, {"mill.txt": "The windmill of Tarsk grinds rye with eleven sails."})
    (docs / "bakery.txt").write_text("The Orrin bakery closed in 2001.", encoding="utf-8")  # changed text

    report = index_documents(docs, index_dir, embedder=embedder(), progress=False)

    assert (report.documents_added, report.chunks_added, report.total_chunks) == (1, 1, 6)
    assert report.unchanged == 4  # harbour, observatory and the two ferry records
    (changed,) = report.skipped
    assert changed.source.endswith("bakery.txt") and "different text" in changed.reason
    retriever = Retriever(ChunkIndex.load(index_dir), embedder())
    assert _top_files(retriever, "How many sails does the Tarsk windmill have?")[0] == "mill.txt"
    # The old documents are still found, and the bakery keeps its first text.
    assert _top_files(retriever, "Who dredged the harbour of Vossel?")[0] == "harbour.md"
    bakery = retriever.retrieve("How much does the dusk roll cost?", 1)[0].chunk
    assert "dusk roll" in bakery.text


def test_only_the_current_generation_stays_on_disk(tmp_path):
    docs, index_dir, _ = _build(tmp_path)
    write_corpus(docs, {"mill.txt": "The windmill of Tarsk grinds rye."})
    index_documents(docs, index_dir, embedder=embedder(), progress=False)
    names = sorted(path.name for path in index_dir.iterdir())
    assert names == [".lock", "chunks-000002.jsonl", "meta.json", "vectors-000002.faiss"]
    # What a save killed after writing its files, before switching meta.json, left: gone next save.
    (index_dir / "vectors-000007.faiss").write_bytes(b"half a generation")
    (index_dir / ".chunks-000003.jsonl.0a1b.tmp").write_text("half a file")
    write_corpus(docs, {"well.txt": "The well of Tarsk is forty metres deep."})
    index_documents(docs, index_dir, embedder=embedder(), progress=False)
    names = sorted(path.name for path in index_dir.iterdir())
    assert names == [".lock", "chunks-000003.jsonl", "meta.json", "vectors-000003.faiss"]


def test_a_failed_save_leaves_the_previous_index_whole(tmp_path, monkeypatch):
    import faiss

    docs, index_dir, _ = _build(tmp_path)
    write_corpus(docs, {"mill.txt": "The windmill of Tarsk grinds rye."})

    def disk_full(index):
        raise OSError("No space left on device")

    monkeypatch.setattr(faiss, "serialize_index", disk_full)
    with pytest.raises(OSError, match="No space left"):
        index_documents(docs, index_dir, embedder=embedder(), progress=False)
    monkeypatch.undo()

    index = ChunkIndex.load(index_dir)
    assert len(index) == 5
    assert not any(name.endswith(".tmp") for name in map(str, index_dir.iterdir()))
    # Running again picks up the document the failed run could not save.
    report = index_documents(docs, index_dir, embedder=embedder(), progress=False)
    assert (report.documents_added, report.total_chunks) == (1, 6)


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_approximate_indexes_find_what_the_exact_one_finds(tmp_path, kind):
    files = {
        f"note{i:02d}.txt": f"Note {i}: the lamp of tower {i} burns {i * 3} hours of whale oil."
        for i in range(40)
    }
    files["mill.txt"] = "The windmill of Tarsk grinds rye with eleven sails."
    docs = write_corpus(tmp_path / "docs", files)
    index_documents(docs, tmp_path / kind, embedder=embedder(), kind=kind, progress=False)
    index_documents(docs, tmp_path / "flat", embedder=embedder(), progress=False)

    approximate = Retriever(ChunkIndex.load(tmp_path / kind), embedder())
    exact = Retriever(ChunkIndex.load(tmp_path / "flat"), embedder())
    assert approximate.index.settings.kind == kind
    for question in [
        "How many sails does the Tarsk windmill have?",
        "How long does the lamp of tower 17 burn?",
    ]:
        assert _top_files(approximate, question, 1) == _top_files(exact, question, 1)


def test_missing_index_is_a_clear_error(tmp_path):
    with pytest.raises(IndexNotFoundError, match=r"No index at .*rag-mspoe index DOCS --index"):
        Retriever.load(tmp_path / "nothing-here")


def test_another_embedding_model_is_refused(tmp_path):
    docs, index_dir, _ = _build(tmp_path)
    with pytest.raises(
        IndexMismatchError, match="built with embedding model 'sentence-transformers/all-MiniLM-L6-v2'"
    ):
        Retriever.load(index_dir, embedding_model="BAAI/bge-small-en-v1.5")
    with pytest.raises(IndexMismatchError, match="not 'BAAI/bge-small-en-v1.5'"):
        index_documents(docs, index_dir, embedding_model="BAAI/bge-small-en-v1.5", progress=False)
    with pytest.raises(IndexMismatchError, match="chunk size 200, not 100"):
        index_documents(docs, index_dir, embedder=embedder(), chunk_size=100, progress=False)
    # The aliases of the default model name the same model.
    assert Retriever.load(index_dir, embedding_model="all-MiniLM-L6-v2").index is not None


def test_a_folder_with_nothing_readable_builds_no_index(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match="No readable documents .* 1 skipped"):
        index_documents(docs, tmp_path / "index", embedder=embedder(), progress=False)
    assert not ChunkIndex.exists(tmp_path / "index")


def test_a_second_writer_is_refused_while_the_first_holds_the_index(tmp_path):
    from rag_mspoe.pipelines.index import writer_lock

    docs, index_dir, _ = _build(tmp_path)
    write_corpus(docs, {"mill.txt": "The windmill of Tarsk grinds rye."})
    with writer_lock(index_dir), pytest.raises(RuntimeError, match="Another process is writing the index"):
        index_documents(docs, index_dir, embedder=embedder(), progress=False)
    assert len(ChunkIndex.load(index_dir)) == 5
    assert index_documents(docs, index_dir, embedder=embedder(), progress=False).total_chunks == 6
