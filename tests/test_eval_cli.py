"""The evaluation commands as a user types them: sweep, report, compare, perplexity, e2e."""

from __future__ import annotations

import gzip
import json
import shutil

import pytest
from eval_run_helpers import save_tiny_chat_model, write_e2e_inputs

from rag_mspoe.cli import main
from rag_mspoe.eval.cli import parse_positions
from rag_mspoe.eval.runs.results import read_records


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=4096)


def test_positions_are_parsed_from_lists_and_keywords():
    assert parse_positions("9,0,4", 10) == [0, 4, 9]
    assert parse_positions("ends", 20) == [0, 9, 19]
    assert parse_positions("all", 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="comma-separated"):
        parse_positions("first", 10)


def test_a_label_added_with_no_report_leaves_the_folders_report(model_dir, tmp_path, capsys):
    common = ["--model", str(model_dir), "--documents", "4", "--samples", "2", "--no-progress"]
    assert main(["sweep", "--out", str(tmp_path), "--methods", "none", *common]) == 0
    published = (tmp_path / "table.md").read_text()
    capsys.readouterr()
    assert main(["sweep", "--out", str(tmp_path), "--methods", "none", "random", "--no-report", *common]) == 0
    assert "12/12 records" in capsys.readouterr().out
    assert (tmp_path / "table.md").read_text() == published and "| random |" not in published
    assert len(read_records(tmp_path / "results.jsonl")) == 12


def test_sweep_report_and_compare_commands(model_dir, tmp_path, capsys):
    common = ["--model", str(model_dir), "--documents", "4", "--samples", "2", "--no-progress"]
    assert main(["sweep", "--out", str(tmp_path / "a"), "--methods", "none", "random", *common]) == 0
    out = capsys.readouterr().out
    assert "12/12 records" in out  # ends of 4 documents: 0, 1, 3 and "| random |" in out
    assert main(["sweep", "--out", str(tmp_path / "b"), "--methods", "none", "pi", *common]) == 0
    capsys.readouterr()

    assert main(["report", str(tmp_path / "a"), "--metric", "gold_logprob"]) == 0
    assert "gold answer log-likelihood" in capsys.readouterr().out
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["main_metric"] == "gold_logprob"

    # One label, reported elsewhere; the run folder's own report is left as it was.
    assert main(["report", str(tmp_path / "a"), "--methods", "random", "--out", str(tmp_path / "only")]) == 0
    assert "| random |" in capsys.readouterr().out
    only = json.loads((tmp_path / "only" / "summary.json").read_text())["metrics"]["gold_logprob"]
    assert list(only["methods"]) == ["random"]
    assert "| none |" in (tmp_path / "a" / "table.md").read_text()
    assert main(["report", str(tmp_path / "a"), "--methods", "pine"]) == 1
    assert "no records for pine; its labels are none, random" in capsys.readouterr().err

    # Leaving out the questions a choice was made on: the report is of the others alone.
    examples = sorted({r["example_id"] for r in read_records(tmp_path / "a" / "results.jsonl")})
    assert len(examples) == 2
    seen = tmp_path / "seen.txt"
    seen.write_text(f"# chosen on\n{examples[0]}\n\n")
    fresh = ["report", str(tmp_path / "a"), "--leave-out", str(seen), "--out", str(tmp_path / "fresh")]
    assert main(fresh) == 0
    capsys.readouterr()
    summary = json.loads((tmp_path / "fresh" / "summary.json").read_text())
    assert summary["left_out"] == {"file": str(seen), "examples": 1}
    assert summary["metrics"]["gold_logprob"]["examples_per_position"] == {"0": 1, "1": 1, "3": 1}
    seen.write_text("\n".join(examples))
    assert main(fresh) == 1
    assert "lists every example" in capsys.readouterr().err
    seen.write_text("# nothing\n")
    assert main(fresh) == 1
    assert "lists no example ids; write one per line" in capsys.readouterr().err

    # A finished run kept compressed in a repository reports as it is, without gunzip.
    kept = tmp_path / "kept"
    kept.mkdir()
    shutil.copy(tmp_path / "a" / "manifest.json", kept)
    with (
        open(tmp_path / "a" / "results.jsonl", "rb") as source,
        gzip.open(kept / "results.jsonl.gz", "wb") as out,
    ):
        shutil.copyfileobj(source, out)
    assert main(["report", str(kept)]) == 0
    capsys.readouterr()
    assert json.loads((kept / "summary.json").read_text())["records"] == 12

    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp")]) == 0
    assert "| none | 0 | 2 |" in capsys.readouterr().out
    assert (tmp_path / "cmp" / "comparison.json").is_file()


def test_bad_sweep_settings_fail_with_the_fix(tmp_path, capsys):
    assert main(["sweep", "--out", str(tmp_path), "--documents", "10", "--positions", "12"]) == 1
    assert "Gold positions [12]" in capsys.readouterr().err
    assert main(["sweep", "--out", str(tmp_path), "--methods", "none", "teleport"]) == 1
    assert "Unknown method 'teleport'" in capsys.readouterr().err


def test_perplexity_command(model_dir, tmp_path, capsys):
    text = tmp_path / "book.txt"
    text.write_text(" ".join(f"line {i} of a long and dull book about harbours." for i in range(200)))
    command = ["perplexity", str(text), "--out", str(tmp_path / "ppl"), "--model", str(model_dir)]
    assert main([*command, "--lengths", "64", "128", "--methods", "none", "yarn:2", "--no-progress"]) == 0
    assert "| yarn:2 |" in capsys.readouterr().out
    assert len(read_records(tmp_path / "ppl" / "results.jsonl")) == 4


def test_e2e_command_records_retrieval_rank_and_prompt_position(model_dir, tmp_path, capsys):
    corpus, questions_file, questions = write_e2e_inputs(tmp_path, questions=4, documents=3, seed=5)
    run = tmp_path / "run"
    command = ["e2e", str(questions_file), str(corpus), "--out", str(run), "--model", str(model_dir)]
    assert main([*command, "-k", "5", "--methods", "none", "longcontextreorder", "--no-progress"]) == 0
    records = read_records(run / "results.jsonl")
    assert len(records) == 6
    by_key = {(r["method"], r["example_id"]): r for r in records}
    for question in questions:
        plain = by_key[("none", question["id"])]
        reordered = by_key[("longcontextreorder", question["id"])]
        assert plain["gold_rank"] is not None and plain["gold_prompt_position"] == plain["gold_rank"] - 1
        # LongContextReorder of 5 chunks puts ranks 1..5 at prompt slots 0, 4, 1, 3, 2.
        slots = {1: 0, 2: 4, 3: 1, 4: 3, 5: 2}
        assert reordered["gold_prompt_position"] == slots[reordered["gold_rank"]]
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["by_rank"]) == {"none", "longcontextreorder"}
    assert (run / "table.md").read_text().startswith("Accuracy")


def test_e2e_retrieves_with_the_first_stage_asked_and_resumes_only_with_it(model_dir, tmp_path, capsys):
    corpus, questions_file, questions = write_e2e_inputs(tmp_path, questions=2, documents=3, seed=8)
    run = tmp_path / "run"
    command = ["e2e", str(questions_file), str(corpus), "--out", str(run), "--model", str(model_dir)]
    command += ["-k", "3", "--methods", "none", "--max-new-tokens", "4", "--no-progress"]
    assert main([*command, "--first-stage", "hybrid"]) == 0
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["e2e"]["first_stage"] == "hybrid"
    assert len(read_records(run / "results.jsonl")) == len(questions)
    assert main([*command, "--first-stage", "lexical"]) != 0
    assert "other settings (first_stage: 'hybrid' there, 'lexical' now)" in capsys.readouterr().err


@pytest.mark.parametrize("chain", ["langchain", "langchain-agent", "llamaindex"])
def test_e2e_through_the_chains_users_write(model_dir, tmp_path, chain):
    corpus, questions_file, questions = write_e2e_inputs(tmp_path, questions=3, documents=3, seed=7)
    run = tmp_path / "run"
    methods = ["none", "invariant-reorder", "longcontextreorder"]
    command = ["e2e", str(questions_file), str(corpus), "--out", str(run), "--model", str(model_dir)]
    assert main([*command, "-k", "5", "--through", chain, "--methods", *methods, "--no-progress"]) == 0
    by_key = {(r["method"], r["example_id"]): r for r in read_records(run / "results.jsonl")}
    slots = {1: 0, 2: 4, 3: 1, 4: 3, 5: 2}  # LongContextReorder of 5 chunks, by retrieval rank
    for question in questions:
        plain, read, reordered = (by_key[(m, question["id"])] for m in methods)
        assert plain["gold_prompt_position"] == plain["gold_rank"] - 1 and plain["packed"] == 5
        assert plain["documents_read"] is None  # the unmodified model reads no documents apart
        assert reordered["gold_prompt_position"] == slots[reordered["gold_rank"]]
        # The method found the chain's five documents and says in which order it read them.
        assert sorted(read["documents_read"]) == list(range(5))
        assert read["gold_read_position"] == read["documents_read"].index(read["gold_prompt_position"])
    summary = json.loads((run / "summary.json").read_text())
    assert "p_vs_none" in summary["overall"]["invariant-reorder"]
    assert summary["overall"]["none"]["seconds_per_answer"] > 0
    assert "| s / answer |" in (run / "table.md").read_text()


def test_e2e_runs_the_methods_that_read_the_packed_documents(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_MSPOE_CACHE", str(tmp_path / "cache"))  # the positional-bias estimates
    corpus, questions_file, _ = write_e2e_inputs(tmp_path, questions=2, documents=3, seed=6)
    run = tmp_path / "run"
    command = ["e2e", str(questions_file), str(corpus), "--out", str(run), "--model", str(model_dir)]
    methods = ["none", "pine", "attention-calibration", "calibrated-reorder"]
    assert main([*command, "-k", "3", "--methods", *methods, "--no-progress"]) == 0
    records = read_records(run / "results.jsonl")
    assert sorted({r["method"] for r in records}) == sorted(methods)
    assert len(records) == len(methods) * len({r["example_id"] for r in records})
