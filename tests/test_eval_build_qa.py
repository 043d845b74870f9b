"""`rag-mspoe build-qa` on a small file of real NQ-open questions (gold passages written for the test)
and a pool of real facts: examples for every record but the one whose answer ("S") is in every
passage, which is skipped and counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rag_mspoe.cli import main
from rag_mspoe.eval.data.build_qa import pool_from_records, split_by_question
from rag_mspoe.eval.data.loaders import load_qa, read_jsonl
from rag_mspoe.eval.data.records import Document, QAExample, gold_index
from rag_mspoe.eval.scoring.metrics import normalize_answer

DATA = Path(__file__).parent / "data"
ORACLE = DATA / "nq-open-sample-oracle.jsonl"
PASSAGES = DATA / "nq-open-sample-passages.jsonl"


def test_build_qa_writes_examples_and_skips_the_record_answered_everywhere(tmp_path, capsys):
    out = tmp_path / "nq5.jsonl.gz"
    assert main(["build-qa", str(ORACLE), "--pool", str(PASSAGES), "--documents", "5", "--gold-at", "2",
                 "--out", str(out), "--index", str(tmp_path / "index")]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert printed.startswith("4 of 5 records built (5 documents, gold at 2, pool of 24 passages); 1 skipped")
    assert f"4 into {out}" in printed
    assert "skipped entropy-symbol: only 0 passages of the pool are free of its answers ['S']" in printed

    examples = load_qa(out)  # what `sweep --data` reads
    records = read_jsonl(ORACLE)
    assert [e.id for e in examples] == ["0", "1", "2", "4"]
    pool = {(d.title, d.text) for d in pool_from_records(read_jsonl(PASSAGES))}
    for example in examples:
        record = records[int(example.id)]
        assert example.question == record["question"] and list(example.answers) == record["answers"]
        assert len(example.documents) == 5 and gold_index(example) == 2
        distractors = [d for d in example.documents if not d.is_gold]
        assert len({d.text for d in distractors}) == 4
        for document in distractors:
            assert (document.title, document.text) in pool
            content = normalize_answer(f"{document.title} {document.text}")
            assert not any(normalize_answer(answer) in content for answer in example.answers)
    physics = examples[0]
    assert physics.documents[2].title == "Nobel Prize in Physics"
    # The retriever puts the passages about Nobel prizes first.
    assert all("Nobel" in d.title or "Nobel" in d.text for d in physics.documents)


def test_build_qa_holds_out_whole_questions(tmp_path, capsys):
    out, heldout = tmp_path / "calibration.jsonl", tmp_path / "heldout.jsonl"
    assert main(["build-qa", str(ORACLE), "--pool", str(PASSAGES), "--documents", "4", "--out", str(out),
                 "--heldout-out", str(heldout), "--split-seed", "3"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert f"2 held out into {heldout}" in printed and f"2 into {out}" in printed
    kept, held = load_qa(out), load_qa(heldout)
    assert sorted(e.id for e in kept + held) == ["0", "1", "2", "4"]
    assert not {e.question for e in kept} & {e.question for e in held}


def test_split_by_question_keeps_a_question_asked_twice_on_one_side():
    gold = (Document("t", "x", is_gold=True, has_answer=True),)
    examples = [QAExample(str(i), q, ("x",), gold) for i, q in enumerate(["Who?", "who", "What?", "Where?"])]
    for seed in range(8):
        kept, held = split_by_question(examples, 0.5, seed)
        assert {e.id for e in kept} | {e.id for e in held} == {"0", "1", "2", "3"}
        assert ({"0", "1"} <= {e.id for e in kept}) or ({"0", "1"} <= {e.id for e in held})
        assert len({e.question.lower().strip("?") for e in held}) == 2  # half of the 3 questions, rounded
    with pytest.raises(ValueError, match="between 0 and 1"):
        split_by_question(examples, 1.0, 0)


def test_build_qa_with_too_small_a_pool_says_so(tmp_path, capsys):
    out = tmp_path / "nq.jsonl"
    arguments = ["build-qa", str(ORACLE), "--pool", str(PASSAGES), "--documents", "30", "--out", str(out)]
    assert main(arguments) == 1
    assert "The pool has 24 passages; 30 documents need at least 29 distractors" in capsys.readouterr().err
    assert not out.exists()


def test_pool_from_records_takes_passages_and_the_free_documents_of_qa_examples():
    qa = {"question": "q", "answers": ["x"], "ctxs": [
        {"title": "g", "text": "x", "isgold": True, "hasanswer": True},
        {"title": "a", "text": "free"}, {"title": "b", "text": "has x", "hasanswer": True}]}  # fmt: skip
    assert pool_from_records([qa, {"title": "a", "text": "free"}, {"title": "c", "text": "more"}]) == [
        Document("a", "free"),
        Document("c", "more"),
    ]
    with pytest.raises(ValueError, match="Pool record 1 is neither a passage"):
        pool_from_records([qa, {"text": "no title"}])


def test_sample_files_are_well_formed():
    for line in ORACLE.read_text().splitlines():
        assert json.loads(line)["answers"]
