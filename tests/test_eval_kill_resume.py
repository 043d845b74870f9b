"""Every evaluation kind, run as a real `rag-mspoe` process on a tiny model: killed with SIGKILL
after some records are written, the rerun writes every missing record and no record twice; then
the same method label bound to another config is refused, and the folder is left as it was;
`report` and `compare` work on the folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import checksums, kill_once_written, run_cli
from eval_run_helpers import save_tiny_chat_model, write_e2e_inputs

from rag_mspoe.cli import main
from rag_mspoe.eval.runs.results import read_records
from rag_mspoe.eval.suites.data import write_suite_data
from rag_mspoe.eval.suites.run import DataFile, SuiteConfig, load_tasks

COMMON = ["--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=4096)


def kill_resume_then_refuse_relabel(
    argv: list,
    relabelled: list,
    run: Path,
    key_fields: tuple[str, ...],
    expected: set[tuple],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """argv labels a method `x`; relabelled is the same command with `x` bound to another config."""
    results = run / "results.jsonl"
    kill_once_written(argv, results, lines=2)
    before = read_records(results)
    assert 2 <= len(before) < len(expected)

    resumed = run_cli(*argv)

    assert resumed.returncode == 0, resumed.stderr[-2000:]
    after = read_records(results)
    keys = [tuple(record[name] for name in key_fields) for record in after]
    assert len(keys) == len(set(keys)) and set(keys) == expected
    assert after[: len(before)] == before
    manifest = json.loads((run / "manifest.json").read_text())
    assert len(manifest["sessions"]) == 2 and manifest["sessions"][-1]["complete"] is True

    untouched = checksums(run)
    capsys.readouterr()
    assert main([str(part) for part in relabelled]) == 1
    refusal = capsys.readouterr().err
    assert f"Method name 'x' meant another config in {run}" in refusal, refusal[-2000:]
    assert "another label" in refusal and "new folder (--out)" in refusal
    assert checksums(run) == untouched


def report_and_compare_know_the_kind(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`report` rewrites the kind's own report; `compare` pairs the run with itself: no differences."""
    (run / "table.md").unlink()
    assert main(["report", str(run)]) == 0
    assert "| x |" in capsys.readouterr().out and (run / "table.md").is_file()
    assert main(["compare", str(run), str(run), "--out", str(run.parent / "cmp")]) == 0
    rows = json.loads((run.parent / "cmp" / "comparison.json").read_text())["rows"]
    assert {row["method"] for row in rows} >= {"none", "x"}
    assert all(row["difference"] == 0 and row["p"] == 1.0 for row in rows)


def test_sweep(model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["sweep", "--out", run, "--model", model_dir, "--documents", "6", "--positions", "0,5"]
    argv += ["--samples", "8", "--batch-size", "2", *COMMON, "--methods", "none"]
    expected = {
        (method, position, f"invented-0-{index}")
        for method in ("none", "x")
        for position in (0, 5)
        for index in range(8)
    }
    kill_resume_then_refuse_relabel(
        [*argv, "x=pi:2"], [*argv, "x=pi:3"], run, ("method", "position", "example_id"), expected, capsys
    )
    report_and_compare_know_the_kind(run, capsys)


def test_suite(model_dir, tmp_path, capsys):
    files = write_suite_data(tmp_path / "data", examples=8)
    data = (DataFile("longbench", str(files["longbench"])), DataFile("mmlu", str(files["mmlu"])))
    run = tmp_path / "run"
    argv = ["suite", "--out", run, "--model", model_dir, "--longbench", files["longbench"]]
    argv += [
        "--mmlu",
        files["mmlu"],
        "--max-length",
        "300",
        "--batch-size",
        "1",
        *COMMON,
        "--methods",
        "none",
    ]
    tasks = load_tasks(SuiteConfig(files=data))
    expected = {(m, task, e.id) for m in ("none", "x") for task, examples in tasks.items() for e in examples}
    kill_resume_then_refuse_relabel(
        [*argv, "x=pi:2"], [*argv, "x=pi:3"], run, ("method", "task", "example_id"), expected, capsys
    )
    report_and_compare_know_the_kind(run, capsys)


def test_harness(model_dir, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    questions = [
        {"question": f"What is {n} plus {n}?", "choices": [str(2 * n), str(n)], "answer": 0} for n in range(8)
    ]
    (tasks / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    (tasks / "sums.yaml").write_text(
        f"task: sums\noutput_type: multiple_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tasks / 'questions.jsonl'}\ntest_split: test\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'
    )
    run = tmp_path / "run"
    argv = ["harness", "--tasks", "sums", "--include-path", tasks, "--out", run, "--model", model_dir]
    methods = ["none", "pi:2", "pi:3", "pi:4", "layerwise", "mspoe"]
    argv += [*COMMON, "--methods", *methods]
    expected = {(m, "sums", "sums", "acc", "none") for m in [*methods, "x"]}
    kill_resume_then_refuse_relabel(
        [*argv, "x=pi:5"],
        [*argv, "x=pi:6"],
        run,
        ("method", "request", "task", "metric", "filter"),
        expected,
        capsys,
    )
    report_and_compare_know_the_kind(run, capsys)


def test_perplexity(model_dir, tmp_path, capsys):
    text = tmp_path / "book.txt"
    text.write_text(" ".join(f"Line {i} of a long and dull book about harbours." for i in range(400)))
    run = tmp_path / "run"
    argv = ["perplexity", text, "--out", run, "--model", model_dir, "--lengths", "256", "--windows", "12"]
    argv += [*COMMON, "--methods", "none"]
    expected = {(m, 256, window) for m in ("none", "x") for window in range(12)}
    kill_resume_then_refuse_relabel(
        [*argv, "x=pi:2"], [*argv, "x=pi:3"], run, ("method", "length", "window"), expected, capsys
    )
    report_and_compare_know_the_kind(run, capsys)


def test_e2e(model_dir, tmp_path, capsys):
    corpus, questions_file, questions = write_e2e_inputs(tmp_path, questions=2, documents=12, seed=3)
    run = tmp_path / "run"
    argv = ["e2e", questions_file, corpus, "--out", run, "--model", model_dir, "-k", "3"]
    argv += ["--max-new-tokens", "16", *COMMON, "--methods", "none"]
    expected = {(m, q["id"]) for m in ("none", "x") for q in questions}
    kill_resume_then_refuse_relabel(
        [*argv, "x=pi:2"], [*argv, "x=pi:3"], run, ("method", "example_id"), expected, capsys
    )
    report_and_compare_know_the_kind(run, capsys)
