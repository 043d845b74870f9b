"""Eval data: records and gold moves, JSONL loaders (gzip, errors naming file and line), the paper's
prompts character for character, and the generators (seeded, the gold fact in the gold document
only, candidates one per document)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import re

import pytest

from rag_mspoe.eval.data.loaders import load_kv, load_qa, read_jsonl, save_jsonl
from rag_mspoe.eval.data.prompts import kv_prompt, qa_prompt
from rag_mspoe.eval.data.records import Document, KVExample, QAExample, gold_index, with_gold_at
from rag_mspoe.eval.data.synthetic import KEY_WORDS, generate_invented_qa, generate_kv
from rag_mspoe.eval.scoring.metrics import normalize_answer

# A record as the published nq-open files write it: no id, extra keys, null flags.
PAPER_QA_RECORD = {
    "question": "who got the first nobel prize in physics",
    "answers": ["Wilhelm Conrad Röntgen"],
    "ctxs": [
        {"id": "628725", "title": "Nobel Prize in Physics", "text": "The first prize went to ...",
         "score": "1.0", "hasanswer": False, "isgold": False, "original_retrieval_index": 0},
        {"title": "Wilhelm Röntgen", "text": "Wilhelm Conrad Röntgen won it in 1901.",
         "hasanswer": True, "isgold": True},
        {"id": "9", "title": "Physics", "text": "Physics is ...", "hasanswer": None, "isgold": None},
    ],
    "nq_annotated_gold": {"title": "Wilhelm Röntgen", "chunked_long_answer": "..."},
}  # fmt: skip
PAPER_KV_RECORD = {
    "ordered_kv_records": [["k1", "v1"], ["k2", "v2"], ["k3", "v3"]],
    "key": "k2",
    "value": "v2",
}


def qa_example(gold_at=2, n=5):
    documents = [Document(f"t{i}", f"text {i}") for i in range(n - 1)]
    documents.insert(gold_at, Document("gold", "the answer is 42", is_gold=True, has_answer=True))
    return QAExample("q1", "what is it?", ("42",), tuple(documents), candidates=("7", "42"))


# -- records ---------------------------------------------------------------------------------------
def test_paper_records_load_with_their_flags():
    example = QAExample.from_dict(PAPER_QA_RECORD, default_id="17")
    assert example.id == "17"
    assert example.answers == ("Wilhelm Conrad Röntgen",)
    assert [d.title for d in example.documents] == ["Nobel Prize in Physics", "Wilhelm Röntgen", "Physics"]
    assert [(d.is_gold, d.has_answer) for d in example.documents] == [
        (False, False),
        (True, True),
        (False, False),
    ]
    assert gold_index(example) == 1
    kv = KVExample.from_dict(PAPER_KV_RECORD, default_id="3")
    assert (kv.id, kv.pairs, kv.key, kv.value) == (
        "3",
        (("k1", "v1"), ("k2", "v2"), ("k3", "v3")),
        "k2",
        "v2",
    )
    assert gold_index(kv) == 1


def test_records_round_trip_through_dicts_and_json():
    example = qa_example()
    assert QAExample.from_dict(json.loads(json.dumps(example.to_dict()))) == example
    kv = KVExample.from_dict(PAPER_KV_RECORD, default_id="0")
    assert KVExample.from_dict(json.loads(json.dumps(kv.to_dict()))) == kv
    assert kv.to_dict()["ordered_kv_records"] == PAPER_KV_RECORD["ordered_kv_records"]


@pytest.mark.parametrize("target", [0, 2, 4])
def test_with_gold_at_moves_only_the_gold_document(target):
    example = qa_example(gold_at=2)
    moved = with_gold_at(example, target)
    assert gold_index(moved) == target
    assert moved.documents[target].title == "gold"
    others = [d.title for d in moved.documents if not d.is_gold]
    assert others == ["t0", "t1", "t2", "t3"]
    assert dataclasses.replace(moved, documents=example.documents) == example
    assert gold_index(example) == 2  # the original is untouched


def test_with_gold_at_moves_the_asked_pair():
    kv = KVExample("k", (("a", "1"), ("b", "2"), ("c", "3"), ("d", "4")), key="c", value="3")
    assert with_gold_at(kv, 0).pairs == (("c", "3"), ("a", "1"), ("b", "2"), ("d", "4"))
    assert with_gold_at(kv, 3).pairs == (("a", "1"), ("b", "2"), ("d", "4"), ("c", "3"))


def test_record_errors():
    with pytest.raises(IndexError, match="out of range for 5 items"):
        with_gold_at(qa_example(), 5)
    no_gold = QAExample("x", "q", ("a",), (Document("t", "a"),))
    assert gold_index(no_gold) is None
    with pytest.raises(ValueError, match="no gold document"):
        with_gold_at(no_gold, 0)
    with pytest.raises(ValueError, match="not among its candidates"):
        QAExample("x", "q", ("a",), (), candidates=("b", "c"))
    with pytest.raises(ValueError, match="several documents as gold"):
        QAExample("x", "q", ("a",), (Document("t", "a", is_gold=True),) * 2)
    with pytest.raises(ValueError, match="duplicate keys"):
        KVExample("x", (("a", "1"), ("a", "2")), "a", "1")
    with pytest.raises(ValueError, match="not in its records"):
        KVExample("x", (("a", "1"), ("b", "2")), "a", "2")


def test_lists_become_tuples():
    example = QAExample("x", "q", ["a"], [Document("t", "a")], ["a", "b"])  # type: ignore[arg-type]
    assert (
        example.answers == ("a",)
        and isinstance(example.documents, tuple)
        and example.candidates == ("a", "b")
    )
    hash(example)


# -- loaders ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["examples.jsonl", "examples.jsonl.gz"])
def test_save_and_load_round_trip(tmp_path, name):
    path = tmp_path / "sub" / name
    qa = generate_invented_qa(4, 3, seed=5)
    save_jsonl(path, qa)
    assert load_qa(path) == qa
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == name.endswith(".gz")
    first = path.read_bytes()
    save_jsonl(path, qa)
    assert path.read_bytes() == first  # same examples, same bytes (no timestamp in the gzip header)
    kv = generate_kv(4, 3, seed=5)
    save_jsonl(path, kv)
    assert load_kv(path) == kv
    assert [p.name for p in path.parent.iterdir()] == [name]


def test_published_files_load_and_get_ids_by_record_index(tmp_path):
    path = tmp_path / "nq-open-3_total_documents_gold_at_1.jsonl.gz"
    body = json.dumps(PAPER_QA_RECORD) + "\n\n" + json.dumps({**PAPER_QA_RECORD, "question": "second"}) + "\n"
    path.write_bytes(gzip.compress(body.encode()))
    examples = load_qa(path)
    assert [(e.id, e.question) for e in examples] == [("0", PAPER_QA_RECORD["question"]), ("1", "second")]
    assert read_jsonl(path)[1]["question"] == "second"


def test_a_malformed_line_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "kv.jsonl"
    lines = [json.dumps(PAPER_KV_RECORD), json.dumps(PAPER_KV_RECORD), '{"ordered_kv_records": [["a", "1"]']
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}, line 3: not valid JSON"):
        load_kv(path)
    gz = tmp_path / "qa.jsonl.gz"
    gz.write_bytes(gzip.compress((json.dumps(PAPER_QA_RECORD) + "\n[1, 2]\n").encode()))
    with pytest.raises(ValueError, match=r"qa\.jsonl\.gz, line 2: expected a JSON object, got list"):
        load_qa(gz)


def test_a_record_with_a_missing_field_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "qa.jsonl"
    broken = {k: v for k, v in PAPER_QA_RECORD.items() if k != "answers"}
    path.write_text(json.dumps(PAPER_QA_RECORD) + "\n" + json.dumps(broken) + "\n")
    with pytest.raises(ValueError, match=r"qa\.jsonl, line 2: 'answers' must be a list of strings"):
        load_qa(path)
    with pytest.raises(ValueError, match=r"line 1: 'ordered_kv_records' must be"):
        load_kv(path)  # a QA file read as KV


def test_damaged_and_missing_files(tmp_path):
    path = tmp_path / "qa.jsonl.gz"
    path.write_bytes(gzip.compress((json.dumps(PAPER_QA_RECORD) + "\n").encode() * 50)[:-30])
    with pytest.raises(ValueError, match="damaged"):
        load_qa(path)
    with pytest.raises(FileNotFoundError, match="No examples file"):
        load_qa(tmp_path / "absent.jsonl")


def test_an_interrupted_save_keeps_the_old_file(tmp_path):
    path = tmp_path / "kv.jsonl.gz"
    old = generate_kv(3, 2, seed=1)
    save_jsonl(path, old)

    def failing():
        yield from generate_kv(3, 2, seed=2)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save_jsonl(path, failing())
    assert load_kv(path) == old
    assert [p.name for p in tmp_path.iterdir()] == ["kv.jsonl.gz"]


# -- prompts ---------------------------------------------------------------------------------------
def test_qa_prompt_is_the_papers():
    example = QAExample(
        "x",
        "test question",
        ("a",),
        (Document("first doc", "first doc text"), Document("second doc", "second doc text", is_gold=True)),
    )
    assert qa_prompt(example) == (
        "Write a high-quality answer for the given question using only the provided search results "
        "(some of which might be irrelevant).\n"
        "\n"
        "Document [1](Title: first doc) first doc text\n"
        "Document [2](Title: second doc) second doc text\n"
        "\n"
        "Question: test question\n"
        "Answer:"
    )


def test_kv_prompt_is_the_papers():
    example = KVExample(
        "x", (("test key1", "test value1"), ("test key2", "test value2"), ("k3", "v3")), "k3", "v3"
    )
    assert kv_prompt(example) == "\n".join(
        [
            "Extract the value corresponding to the specified key in the JSON object below.",
            "",
            "JSON data:",
            '{"test key1": "test value1",',
            ' "test key2": "test value2",',
            ' "k3": "v3"}',
            "",
            'Key: "k3"',
            "Corresponding value:",
        ]
    )


def test_prompts_follow_the_document_order():
    example = qa_example(gold_at=0)
    moved = qa_prompt(with_gold_at(example, 4))
    assert "Document [5](Title: gold) the answer is 42\n\nQuestion: what is it?" in moved
    assert "Document [1](Title: t0) text 0\n" in moved


# -- generators ------------------------------------------------------------------------------------
UUID4 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def test_kv_generator_is_seeded_and_uses_uuid4():
    examples = generate_kv(20, 30, seed=7)
    assert examples == generate_kv(20, 30, seed=7)
    assert examples != generate_kv(20, 30, seed=8)
    for example in examples:
        assert len(example.pairs) == 20
        assert all(UUID4.match(k) and UUID4.match(v) for pair in example.pairs for k, v in [pair])
        assert example.pairs[gold_index(example)] == (example.key, example.value)
    assert len({gold_index(e) for e in examples}) > 5  # the asked-for pair is not always in one place
    assert len({e.id for e in examples}) == 30


def test_kv_generator_short_keys():
    examples = generate_kv(12, 10, seed=0, short_keys=True)
    for example in examples:
        keys = [k for k, _ in example.pairs]
        values = [v for _, v in example.pairs]
        assert set(keys) <= set(KEY_WORDS) and len(set(keys)) == 12
        assert all(re.fullmatch(r"\d{4}", v) for v in values) and len(set(values)) == 12
    with pytest.raises(ValueError, match="fewer pairs"):
        generate_kv(len(KEY_WORDS) + 1, 1, seed=0, short_keys=True)
    with pytest.raises(ValueError, match="num_pairs must be at least 2"):
        generate_kv(1, 1, seed=0)


@pytest.mark.parametrize(("similarity", "fillers"), [(0.0, 0), (0.5, 2), (1.0, 4), (1.0, 0)])
def test_invented_qa_gold_fact_only_in_the_gold_document(similarity, fillers):
    examples = generate_invented_qa(
        10, 40, seed=3, distractor_similarity=similarity, filler_sentences=fillers
    )
    for example in examples:
        gold = gold_index(example)
        assert gold is not None and len(example.documents) == 10
        assert all(d.text.count(". ") == fillers and d.text.endswith(".") for d in example.documents)
        texts = [normalize_answer(f"{d.title} {d.text}") for d in example.documents]
        entity = example.documents[gold].title
        assert entity in example.question
        assert [i for i, t in enumerate(texts) if normalize_answer(entity) in t] == [gold]
        assert [i for i, t in enumerate(texts) if normalize_answer(example.answers[0]) in t] == [gold]
        # Every document holds exactly one candidate, and every candidate one document.
        assert len(example.candidates) == 10 and example.answers[0] in example.candidates
        holders = [[i for i, t in enumerate(texts) if normalize_answer(c) in t] for c in example.candidates]
        assert sorted(i for found in holders for i in found) == list(range(10))
    assert len({gold_index(e) for e in examples}) > 5


def test_invented_qa_is_seeded():
    assert generate_invented_qa(6, 5, seed=11) == generate_invented_qa(6, 5, seed=11)
    assert generate_invented_qa(6, 5, seed=11) != generate_invented_qa(6, 5, seed=12)


def _states_gold_fact_pattern(example, document):
    """Whether `document` states its value in the very sentence pattern of the gold fact."""
    gold = example.documents[gold_index(example)]
    sentence = next(s for s in re.split(r"(?<=\.) ", gold.text) if example.answers[0] in s)
    pattern = sentence.replace(gold.title, "{e}").replace(example.answers[0], "{v}")
    value = next(c for c in example.candidates if c in document.text)
    return pattern.format(e=document.title, v=value) in document.text


def test_distractor_similarity_sets_how_alike_distractors_are():
    alike = generate_invented_qa(8, 20, seed=4, distractor_similarity=1.0, filler_sentences=1)
    unlike = generate_invented_qa(8, 20, seed=4, distractor_similarity=0.0, filler_sentences=1)
    for example in alike:
        prefix = example.documents[gold_index(example)].title[:3]
        for document in example.documents:
            assert document.title.startswith(prefix)
            assert _states_gold_fact_pattern(example, document)
    for example in unlike:
        prefix = example.documents[gold_index(example)].title[:3]
        distractors = [d for d in example.documents if not d.is_gold]
        assert not any(_states_gold_fact_pattern(example, d) for d in distractors)
        assert sum(d.title.startswith(prefix) for d in distractors) <= 2  # only by chance


def test_invented_qa_argument_checks():
    with pytest.raises(ValueError, match=r"distractor_similarity must be in \[0, 1\]"):
        generate_invented_qa(5, 1, seed=0, distractor_similarity=1.5)
    with pytest.raises(ValueError, match="num_documents must be at least 1"):
        generate_invented_qa(0, 1, seed=0)
    with pytest.raises(ValueError, match="num_examples must be at least 1"):
        generate_invented_qa(5, 0, seed=0)
    with pytest.raises(ValueError, match=r"filler_sentences must be in \[0, 4\]"):
        generate_invented_qa(5, 1, seed=0, filler_sentences=5)
