"""Run folders resumed with other settings, run as real `rag-mspoe` processes: a label that now
means another method, another questions file, corpus, k or token budget, or a manifest deleted
under existing results is refused with the file and the fix, and the folder is left as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import checksums, run_cli
from eval_run_helpers import save_tiny_chat_model

from rag_mspoe.eval.data.synthetic import generate_invented_qa
from rag_mspoe.eval.runs.results import read_records


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=4096)


def _questions_and_corpus(folder: Path, seed: int) -> tuple[Path, Path]:
    corpus = folder / f"corpus{seed}"
    corpus.mkdir()
    questions = []
    for example in generate_invented_qa(2, 3, seed=seed):
        for number, document in enumerate(example.documents):
            (corpus / f"{example.id}-{number}.md").write_text(f"# {document.title}\n\n{document.text}\n")
        questions.append({"id": example.id, "question": example.question, "answers": list(example.answers)})
    questions_file = folder / f"questions{seed}.jsonl"
    questions_file.write_text("".join(json.dumps(q) + "\n" for q in questions))
    return questions_file, corpus


def test_e2e_refuses_to_resume_under_other_settings_or_a_relabelled_method(model_dir, tmp_path):
    questions, corpus = _questions_and_corpus(tmp_path, seed=5)
    other_questions, other_corpus = _questions_and_corpus(tmp_path, seed=6)
    run = tmp_path / "run"
    common = ["--model", model_dir, "--no-progress", "--threads", "1"]
    first = run_cli("e2e", questions, corpus, "--out", run, "-k", "3", "--methods", "a=none", *common)
    assert first.returncode == 0, first.stderr[-2000:]
    assert len(read_records(run / "results.jsonl")) == 3
    before = checksums(tmp_path)

    altered = {
        "method": ([questions, corpus, "-k", "3", "--methods", "a=pi:2"], "Method name 'a' meant another"),
        "questions": ([other_questions, corpus, "-k", "3", "--methods", "a=none"], "questions: "),
        "corpus": ([questions, other_corpus, "-k", "3", "--methods", "a=none"], "corpus: "),
        "k": ([questions, corpus, "-k", "4", "--methods", "a=none"], "k: 3 there, 4 now"),
        "budget": (
            [questions, corpus, "-k", "3", "--methods", "a=none", "--max-new-tokens", "8"],
            "max_new_tokens: 64 there, 8 now",
        ),
    }
    for name, (argv, message) in altered.items():
        result = run_cli("e2e", *argv, "--out", run, *common)
        assert result.returncode == 1, name
        assert message in result.stderr, (name, result.stderr[-2000:])
        assert str(run) in result.stderr
        assert "new folder (--out)" in result.stderr or "another label" in result.stderr
        assert checksums(tmp_path) == before, name

    (run / "manifest.json").unlink()
    argv = [questions, corpus, "--out", run, "-k", "3", "--methods", "a=none", "b=pi:2"]
    orphaned = run_cli("e2e", *argv, *common)
    assert orphaned.returncode == 1
    assert f"{run / 'results.jsonl'} holds records but {run / 'manifest.json'} is missing" in orphaned.stderr
    assert not (run / "manifest.json").exists()


def test_perplexity_refuses_a_label_that_now_means_another_method(model_dir, tmp_path):
    text = tmp_path / "book.txt"
    text.write_text(" ".join(f"line {i} of a long and dull book about harbours." for i in range(100)))
    other = tmp_path / "other.txt"
    other.write_text(text.read_text().replace("harbours", "lighthouses"))
    run = tmp_path / "ppl"
    common = ["--out", run, "--model", model_dir, "--no-progress", "--threads", "1", "--lengths", "32"]
    first = run_cli("perplexity", text, *common, "--methods", "none", "x=pi:2")
    assert first.returncode == 0, first.stderr[-2000:]
    before = checksums(tmp_path)

    relabelled = run_cli("perplexity", text, *common, "--methods", "none", "x=yarn:2")
    assert relabelled.returncode == 1
    assert f"Method name 'x' meant another config in {run}" in relabelled.stderr
    other_text = run_cli("perplexity", other, *common, "--methods", "none")
    assert other_text.returncode == 1
    assert "holds a perplexity run with other settings (text: " in other_text.stderr
    assert checksums(tmp_path) == before

    # More lengths under the same labels resume and add only the new records.
    grown = run_cli("perplexity", text, *common, "64", "--methods", "none", "x=pi:2")
    assert grown.returncode == 0, grown.stderr[-2000:]
    assert len(read_records(run / "results.jsonl")) == 4
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["perplexity"]["lengths"] == [32, 64] and len(manifest["sessions"]) == 2


def test_a_sweep_whose_manifest_was_deleted_refuses_to_resume(model_dir, tmp_path):
    run = tmp_path / "sweep"
    command = ["sweep", "--out", run, "--model", model_dir, "--documents", "4", "--samples", "2"]
    command += ["--methods", "none", "--no-progress", "--threads", "1"]
    first = run_cli(*command)
    assert first.returncode == 0, first.stderr[-2000:]
    (run / "manifest.json").unlink()
    before = checksums(tmp_path)

    resumed = run_cli(*command)

    assert resumed.returncode == 1
    assert f"{run / 'results.jsonl'} holds records but {run / 'manifest.json'} is missing" in resumed.stderr
    assert "restore manifest.json, or write into a new folder" in resumed.stderr
    assert checksums(tmp_path) == before


@pytest.mark.parametrize("spec", ["none=pi", "pi=mspoe", "mspoe+"])
def test_a_new_sweep_refuses_a_relabelled_method_name_or_an_empty_part(model_dir, tmp_path, spec):
    run = tmp_path / "run"
    result = run_cli("sweep", "--out", run, "--model", model_dir, "--methods", "none", spec, "--samples", "1")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert ("binds the method name" if "=" in spec else "has an empty part") in result.stderr
    assert not run.exists()


def test_a_run_folder_moved_with_its_inputs_resumes(model_dir, tmp_path):
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    text = project / "data" / "book.txt"
    text.write_text(" ".join(f"line {i} of a long and dull book about harbours." for i in range(100)))
    common = ["--model", model_dir, "--no-progress", "--threads", "1", "--methods", "none"]
    first = run_cli("perplexity", text, "--out", project / "runs" / "ppl", *common, "--lengths", "32")
    assert first.returncode == 0, first.stderr[-2000:]
    manifest = json.loads((project / "runs" / "ppl" / "manifest.json").read_text())
    assert manifest["perplexity"]["text"] == "../../data/book.txt"  # where the input sits beside the run
    assert list(manifest["data"]) == ["../../data/book.txt"]

    moved = tmp_path / "clone"
    project.rename(moved)
    run = moved / "runs" / "ppl"
    grown = run_cli("perplexity", moved / "data" / "book.txt", "--out", run, *common, "--lengths", "32", "64")
    assert grown.returncode == 0, grown.stderr[-2000:]
    assert len(read_records(run / "results.jsonl")) == 2

    # A run written when manifests kept absolute paths resumes too.
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["perplexity"]["text"] = str(moved / "data" / "book.txt")
    manifest["data"] = {str(moved / "data" / "book.txt"): manifest["data"]["../../data/book.txt"]}
    (run / "manifest.json").write_text(json.dumps(manifest))
    again = run_cli("perplexity", moved / "data" / "book.txt", "--out", run, *common, "--lengths", "32", "64")
    assert again.returncode == 0, again.stderr[-2000:]
    assert len(read_records(run / "results.jsonl")) == 2
