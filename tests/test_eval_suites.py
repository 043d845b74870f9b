"""Side-effect suites: the LongBench / ZeroSCROLLS / MMLU record formats, middle truncation, the
resumable suite runner (on a tiny model) and the side-effect table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from eval_run_helpers import tiny_chat_model

from rag_mspoe.eval.scoring.text_metrics import score_text
from rag_mspoe.eval.suites.data import write_suite_data
from rag_mspoe.eval.suites.knowledge import load_choices
from rag_mspoe.eval.suites.long_context import LONGBENCH_TASKS, load_long
from rag_mspoe.eval.suites.report import position_gains, side_effect_table, summarize_suite
from rag_mspoe.eval.suites.run import DataFile, SuiteConfig, prompt_within, run_suite


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_longbench_records_fill_the_task_prompt(tmp_path):
    path = write_jsonl(
        tmp_path / "hotpotqa.jsonl",
        [{"_id": "a1", "input": "Who?", "context": "Passage 1:\n{x: 1}", "answers": ["Ann"], "length": 3}],
    )
    (example,) = load_long(path, "longbench")
    assert example.task == "hotpotqa" and example.answers == ("Ann",)
    assert example.spec.max_new_tokens == 32 and example.spec.metric == "qa_f1"
    # Braces in the context stay as they are (no str.format), and both slots are filled.
    assert example.prompt == LONGBENCH_TASKS["hotpotqa"].prompt.replace(
        "{context}", "Passage 1:\n{x: 1}"
    ).replace("{input}", "Who?")
    assert example.prompt.endswith("Question: Who?\nAnswer:")


def test_longbench_task_names_overrides_and_errors(tmp_path):
    # LongBench-E files end in _e; the "dataset" field wins over the file name.
    path = write_jsonl(
        tmp_path / "trec_e.jsonl",
        [{"_id": "1", "input": "q", "context": "c", "answers": ["x"], "all_classes": ["x", "y"]}],
    )
    (example,) = load_long(path, "longbench")
    assert example.task == "trec" and example.classes == ("x", "y") and not example.spec.chat
    custom = write_jsonl(
        tmp_path / "mine.jsonl",
        [{"_id": "1", "input": "q", "context": "c", "answers": ["x"], "prompt": "{context} / {input}",
          "max_new_tokens": 5, "metric": "exact_match"}],
    )  # fmt: skip
    (own,) = load_long(custom, "longbench")
    assert own.prompt == "c / q" and own.spec.max_new_tokens == 5
    bare = write_jsonl(
        tmp_path / "unknown.jsonl", [{"_id": "1", "input": "q", "context": "c", "answers": ["x"]}]
    )
    with pytest.raises(ValueError, match="not built in.*prompt, max_new_tokens, metric"):
        load_long(bare, "longbench")
    broken = write_jsonl(tmp_path / "qasper.jsonl", [{"_id": "1", "input": "q", "answers": ["x"]}])
    with pytest.raises(ValueError, match="record 1: 'context' must be a string"):
        load_long(broken, "longbench")


def test_zeroscrolls_rows_of_one_id_are_one_example_with_several_references(tmp_path):
    path = write_jsonl(
        tmp_path / "narrative_qa.jsonl",
        [
            {"id": "n1", "input": "Story... Question: who?\nAnswer:", "output": "Ann"},
            {"id": "n1", "input": "Story... Question: who?\nAnswer:", "output": "Ann Lee"},
            {"id": "n2", "input": "Other", "output": "Bo"},
        ],
    )
    first, second = load_long(path, "zeroscrolls")
    assert first.answers == ("Ann", "Ann Lee") and first.prompt == "Story... Question: who?\nAnswer:"
    assert first.spec.metric == "qa_f1" and second.answers == ("Bo",)
    hidden = write_jsonl(tmp_path / "qasper.jsonl", [{"id": "t", "input": "x", "output": None}])
    with pytest.raises(ValueError, match="validation split"):
        load_long(hidden, "zeroscrolls")


def test_mmlu_jsonl_and_original_csv(tmp_path):
    path = write_jsonl(
        tmp_path / "astronomy.jsonl",
        [
            {"question": "Closest star?", "choices": ["Sun", "Vega", "Sirius", "Rigel"], "answer": 0},
            {"question": "Red planet?", "choices": ["Venus", "Mars"], "answer": "B", "subject": "planets"},
        ],
    )
    first, second = load_choices(path)
    assert first.subject == "astronomy" and first.answer == 0 and second.answer == 1
    assert first.prompt() == (
        "The following are multiple choice questions (with answers) about astronomy.\n\n"
        "Closest star?\nA. Sun\nB. Vega\nC. Sirius\nD. Rigel\nAnswer:"
    )
    assert first.continuations("letter") == [" A", " B", " C", " D"]
    assert first.prompt("text") == (
        "The following are questions (with answers) about astronomy.\n\nClosest star?\nAnswer:"
    )
    assert second.continuations("text") == [" Venus", " Mars"]
    csv = tmp_path / "college_physics_test.csv"
    csv.write_text('"What is 1+1, roughly?",1,2,3,4,B\n')
    (row,) = load_choices(csv)
    assert row.subject == "college_physics" and row.choices == ("1", "2", "3", "4") and row.answer == 1
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "choices": ["a", "b"], "answer": "Z"}])
    with pytest.raises(ValueError, match="record 1: answer must be"):
        load_choices(bad)


def test_the_middle_cut_keeps_head_and_tail():
    from rag_mspoe.engine.engine_generation import middle_cut

    assert middle_cut(10, 4) == (2, 8, 6)  # tokens 0, 1 and 8, 9 stay
    assert middle_cut(10, 5) == (2, 7, 5)
    assert middle_cut(3, 5) == (3, 3, 0)


@pytest.fixture(scope="module")
def tiny():
    return tiny_chat_model()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_suite_data(tmp_path_factory.mktemp("data"), examples=3, seed=1)


def suite_config(data, **overrides):
    files = (
        DataFile("longbench", str(data["longbench"])),
        DataFile("longbench", str(data["longbench-kv"])),
        DataFile("zeroscrolls", str(data["zeroscrolls"])),
        DataFile("mmlu", str(data["mmlu"])),
    )
    settings = {"files": files, "methods": ("none", "pi:2"), "samples": 2, "max_length": 300, "batch_size": 2}
    return SuiteConfig(**{**settings, **overrides})


def test_middle_cut_prompt_keeps_instructions_and_question(tiny, data):
    from rag_mspoe.engine import Engine

    engine = Engine(*tiny)
    example = load_long(data["longbench"], "longbench")[2]  # 60 passages: well over 300 tokens
    (message,), removed = prompt_within(engine, example, 300)
    text, documents = message["content"], message["document_spans"]
    full = engine.encode(example.prompt)
    assert removed == len(full) - 300 and len(engine.encode(text)) == pytest.approx(300, abs=3)
    assert text.startswith("Answer the question based on the given passages.")
    assert text.endswith(f"Question: {example.input}\nAnswer:")
    # The kept text is the prompt's head and tail; what is left of the passages is still marked.
    head = next(i for i in range(len(text)) if text[i] != example.prompt[i])
    assert example.prompt.endswith(text[head:])
    assert len(documents) >= 2 and text[slice(*documents[0])].startswith("Passage 1:")
    # Passages inside the cut are gone; one the cut falls in keeps its head, or its tail.
    starts = [text[slice(*span)].startswith("Passage ") for span in documents]
    assert starts.count(False) <= 1 and all(
        a[1] <= b[0] for a, b in zip(documents, documents[1:], strict=False)
    )


def test_prompts_say_where_their_passages_and_documents_are(tmp_path):
    path = write_jsonl(
        tmp_path / "hotpotqa.jsonl",
        [{"_id": "a", "input": "Who? {input}", "context": "Passage 1:\nAnn {input}\n\nPassage 2:\nBob\n",
          "answers": ["Ann"]},
         {"_id": "b", "input": "Who?", "context": "Passage 2:\nAnn\nPassage 1:\nBob", "answers": ["Ann"]}],
    )  # fmt: skip
    first, unordered = load_long(path, "longbench")
    text, spans = first.prompt_with_documents()
    assert [text[a:b] for a, b in spans] == ["Passage 1:\nAnn {input}", "Passage 2:\nBob"]
    assert text.count("{input}") == 2  # the slots are filled once: text in the context stays as it is
    text, spans = unordered.prompt_with_documents()  # passages not numbered 1, 2: one document
    assert [text[a:b] for a, b in spans] == [unordered.context]
    scrolls = write_jsonl(
        tmp_path / "qasper.jsonl",
        [{"id": "1", "input": "Read: the doc. Q?", "output": "x", "document_start_index": 6,
          "document_end_index": 14},
         {"id": "2", "input": "Read: the doc. Q?", "output": "y"}],
    )  # fmt: skip
    marked, unmarked = load_long(scrolls, "zeroscrolls")
    assert marked.prompt_with_documents() == ("Read: the doc. Q?", [(6, 14)])
    assert unmarked.prompt_with_documents() == ("Read: the doc. Q?", None)
    bad = write_jsonl(
        tmp_path / "quality.jsonl",
        [{"id": "1", "input": "short", "output": "x", "document_start_index": 2, "document_end_index": 99}],
    )
    with pytest.raises(ValueError, match=r"record 1: document_start_index 2 and document_end_index 99.*<= 5"):
        load_long(bad, "zeroscrolls")


def test_methods_that_read_documents_run_the_suites(tiny, data, tmp_path):
    config = suite_config(data, methods=("none", "pine", "calibrated-reorder"), samples=1)
    run_suite(config, tmp_path, model=tiny[0], tokenizer=tiny[1], progress=False)
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    by_method = {m: {r["task"]: r for r in records if r["method"] == m} for m in config.methods}
    assert len(records) == 3 * 4
    # A knowledge question has no documents: both methods are the unmodified model there.
    for method in ("pine", "calibrated-reorder"):
        assert (
            by_method[method]["mmlu/general_knowledge"]["choice"]
            == by_method["none"]["mmlu/general_knowledge"]["choice"]
        )
    unmarked = tmp_path / "scrolls.jsonl"
    unmarked.write_text(
        "".join(
            json.dumps({k: v for k, v in json.loads(line).items() if not k.startswith("document_")}) + "\n"
            for line in Path(data["zeroscrolls"]).read_text().splitlines()
        )
    )
    own = SuiteConfig(files=(DataFile("zeroscrolls", str(unmarked)),), methods=("none", "pine"), samples=1)
    with pytest.raises(
        ValueError, match="pine read the documents.*document_start_index and document_end_index"
    ):
        run_suite(own, tmp_path / "own", model=tiny[0], tokenizer=tiny[1], progress=False)
    assert not (tmp_path / "own" / "results.jsonl").exists()


def test_suite_scores_every_method_task_and_example_once_and_resumes(tiny, data, tmp_path):
    config = suite_config(data)
    summary = run_suite(config, tmp_path, model=tiny[0], tokenizer=tiny[1], progress=False)
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    keys = {(r["method"], r["task"], r["example_id"]) for r in records}
    assert len(keys) == len(records) == 2 * 4 * 2
    for record in records:
        assert 0.0 <= record["score"] <= 1.0
        if "prediction" in record:  # a long-context answer: its score is its task metric
            example = next(
                e for e in load_long(data[_kind(record["task"])], _suite(record["task"]))
                if e.id == record["example_id"]
            )  # fmt: skip
            assert record["score"] == score_text(record["metric"], record["prediction"], example.answers)
            assert record["prompt_tokens"] <= 300 + 64
        else:
            assert record["score"] == float(record["choice"] == record["answer"])
    assert summary["tasks"]["longbench/invented_passages_qa"]["truncated"] == 2  # 20 and 40 passages
    assert set(summary["methods"]) == {"none", "pi:2"}
    assert (tmp_path / "table.md").read_text().count("|") > 20
    again = run_suite(config, tmp_path, model=tiny[0], tokenizer=tiny[1], progress=False)
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == len(records)
    assert again["methods"]["none"] == summary["methods"]["none"]


def test_suite_refuses_changed_data_other_settings_and_reordering(tiny, data, tmp_path):
    config = suite_config(data, samples=1, methods=("none",))
    run_suite(config, tmp_path, model=tiny[0], tokenizer=tiny[1], progress=False)
    with pytest.raises(ValueError, match="other settings \\(max_length: 300 there, 200 now\\)"):
        run_suite(suite_config(data, samples=1, methods=("none",), max_length=200), tmp_path, model=tiny[0],
                  tokenizer=tiny[1], progress=False)  # fmt: skip
    changed = tmp_path / "copy.jsonl"
    changed.write_text(Path(data["mmlu"]).read_text())
    own = SuiteConfig(files=(DataFile("mmlu", str(changed)),), methods=("none",), samples=1)
    run_suite(own, tmp_path / "own", model=tiny[0], tokenizer=tiny[1], progress=False)
    changed.write_text(changed.read_text().replace("capital", "Capital"))
    with pytest.raises(
        ValueError,
        match="copy.jsonl changed since the run in .* it has sha256 [0-9a-f]{64} now, the run recorded",
    ):
        run_suite(own, tmp_path / "own", model=tiny[0], tokenizer=tiny[1], progress=False)
    with pytest.raises(ValueError, match="binds the method name 'none' to another method"):
        run_suite(suite_config(data, samples=1, methods=("none=pi:2",)), tmp_path, model=tiny[0],
                  tokenizer=tiny[1], progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="reorder retrieved documents"):
        run_suite(suite_config(data, methods=("none", "longcontextreorder")), tmp_path / "lcr", model=tiny[0],
                  tokenizer=tiny[1], progress=False)  # fmt: skip


def test_summary_and_side_effect_table_by_hand(tmp_path):
    records = [
        {"method": m, "task": t, "example_id": i, "metric": "qa_f1", "score": s}
        for m, t, i, s in [
            ("none", "longbench/a", "1", 1.0), ("none", "longbench/a", "2", 0.0),
            ("none", "longbench/b", "1", 0.5), ("none", "mmlu/k", "1", 1.0), ("none", "mmlu/k", "2", 1.0),
            ("pi", "longbench/a", "1", 1.0), ("pi", "longbench/a", "2", 1.0),
            ("pi", "longbench/b", "1", 0.0), ("pi", "mmlu/k", "1", 1.0), ("pi", "mmlu/k", "2", 0.0),
            ("pi", "mmlu/k", "3", 1.0),  # only pi has it: left out of the paired comparison
        ]
    ]  # fmt: skip
    summary = summarize_suite(records)
    # none: task a 0.5, task b 0.5 -> long 0.5; pi: a 1.0, b 0.0 -> long 0.5. Short: 1.0 vs 0.5.
    assert (
        summary["methods"]["none"]["long_context"] == 0.5 and summary["methods"]["pi"]["long_context"] == 0.5
    )
    assert (
        summary["methods"]["none"]["short_context"] == 1.0
        and summary["methods"]["pi"]["short_context"] == 0.5
    )
    assert summary["tasks"]["mmlu/k"]["examples"] == 2

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    sweep_records = [
        {"method": m, "position": p, "example_id": i, "choice_correct": s}
        for m, p, i, s in [
            ("none", 0, "1", 1.0), ("none", 0, "2", 1.0), ("none", 1, "1", 0.0), ("none", 1, "2", 0.0),
            ("pi", 0, "1", 1.0), ("pi", 0, "2", 0.0), ("pi", 1, "1", 1.0), ("pi", 1, "2", 0.0),
        ]
    ]  # fmt: skip
    write_jsonl(sweep / "results.jsonl", sweep_records)
    gains = position_gains(sweep)
    # none: positions 1.0 and 0.0 (average 0.5, worst 0); pi: 0.5 and 0.5 (average 0.5, worst 0.5).
    assert gains["pi"]["average_gain"] == pytest.approx(0.0) and gains["pi"]["worst_gain"] == pytest.approx(
        50.0
    )
    table = side_effect_table(summary, {**gains, "longcontextreorder": {**gains["pi"], "average_gain": 1.0}})
    assert "| pi | +0.0 / +50.0 | 50.0 (+0.0, p=1) | 50.0 (-50.0, p=1) |" in table
    assert "| longcontextreorder | +1.0 / +50.0 | n/a | n/a |" in table


def _kind(task: str) -> str:
    return {"longbench/invented_passages_qa": "longbench", "longbench/kv_retrieval": "longbench-kv",
            "zeroscrolls/invented_story_qa": "zeroscrolls"}[task]  # fmt: skip


def _suite(task: str) -> str:
    return task.split("/")[0]


def test_commands_write_data_run_the_suite_and_report_with_a_sweep(tmp_path, capsys):
    from eval_run_helpers import save_tiny_chat_model

    from rag_mspoe.cli import main

    model = save_tiny_chat_model(tmp_path / "model")
    assert main(["suite-data", "--out", str(tmp_path / "data"), "--examples", "2"]) == 0
    data = tmp_path / "data"
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    write_jsonl(
        sweep / "results.jsonl",
        [
            {"method": m, "position": 0, "example_id": "1", "choice_correct": s}
            for m, s in [("none", 0.0), ("pi", 1.0)]
        ],
    )
    run = tmp_path / "run"
    args = ["suite", "--out", str(run), "--model", str(model), "--methods", "none", "pi", "--samples", "1"]
    args += ["--longbench", str(data / "longbench" / "kv_retrieval.jsonl"), "--max-length", "128"]
    args += ["--mmlu", f"{data / 'mmlu' / 'general_knowledge.jsonl'}:trivia", "--no-progress"]
    assert main(args) == 0
    assert main(["report", str(run), "--sweep", str(sweep)]) == 0
    printed = capsys.readouterr().out
    assert "| mmlu/trivia |" in printed and "| pi | +100.0 / +100.0 |" in printed
    assert (run / "side_effects.md").read_text().count("\n| ") == 2
