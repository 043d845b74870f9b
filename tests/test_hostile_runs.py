"""Run folders resumed with other settings, run as real `rag-mspoe` processes: a label that now
means another method, another questions file, corpus, k or token budget, or a manifest deleted
under existing results is refused with the file and the fix, and the folder is left as it was."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
from cli_helpers import checksums, run_cli
from eval_run_helpers import save_tiny_chat_model

from rag_mspoe.eval.data.loaders import save_jsonl
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


def test_e2e_refuses_a_corpus_folder_changed_under_it_and_resumes_on_the_same_files(model_dir, tmp_path):
    questions, corpus = _questions_and_corpus(tmp_path, seed=5)
    run = tmp_path / "run"
    argv = [questions, corpus, "--out", run, "-k", "3", "--methods", "a=none", "--model", model_dir]
    argv += ["--no-progress", "--threads", "1"]
    assert run_cli("e2e", *argv).returncode == 0
    document = sorted(corpus.iterdir())[0]
    original = document.read_text()
    (corpus / ".notes.md").write_text("hidden files are not indexed")  # so they change nothing
    assert run_cli("e2e", *argv).returncode == 0
    before = checksums(run)
    for change in ("edited", "added"):
        if change == "edited":
            document.write_text(original + "\nA sentence added later.\n")
        else:
            document.write_text(original)
            (corpus / "new.md").write_text("# New\n\nA document added later.\n")
        refused = run_cli("e2e", *argv)
        assert refused.returncode == 1, change
        assert f"{corpus} changed since the run in {run} started" in refused.stderr, refused.stderr[-2000:]
        assert "Restore the file (or folder) the run started with" in refused.stderr
        assert checksums(run) == before, change  # the run folder as it was
    (corpus / "new.md").unlink()
    assert run_cli("e2e", *argv).returncode == 0  # the files it started with: resumed


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


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("none=pi", "binds the method name 'none' to another method"),
        ("pi=mspoe", "binds the method name 'pi' to another method"),
        ("mspoe+", "has an empty part"),
        ("pi:2=none", "binds the label 'pi:2', written like a method spec (it holds ':')"),
        ("mspoe+pi=none", "binds the label 'mspoe+pi', written like a method spec (it holds '+')"),
    ],
)
def test_a_new_sweep_refuses_a_relabelled_method_name_a_spec_shaped_label_or_an_empty_part(
    model_dir, tmp_path, spec, message
):
    run = tmp_path / "run"
    result = run_cli("sweep", "--out", run, "--model", model_dir, "--methods", "none", spec, "--samples", "1")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert message in result.stderr
    assert ("Pick another label" if "=" in spec else "remove the stray '+'") in result.stderr.replace(
        "Pick a label", "Pick another label"
    )
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


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_resumed_sweep_refuses_another_data_file_and_takes_the_same_bytes_anywhere(model_dir, tmp_path):
    first, second = generate_invented_qa(4, 3, seed=3), generate_invented_qa(4, 3, seed=4)
    data = tmp_path / "data" / "questions.jsonl"
    data.parent.mkdir()
    save_jsonl(data, first)
    original = data.read_bytes()
    run = tmp_path / "run"
    common = ["--out", run, "--model", model_dir, "--documents", "4", "--samples", "2", "--metrics", "loglik"]
    common += ["--methods", "none", "--no-progress", "--threads", "1"]
    started = run_cli("sweep", "--data", data, *common)
    assert started.returncode == 0, started.stderr[-2000:]
    assert json.loads((run / "manifest.json").read_text())["data"] == {
        "../data/questions.jsonl": _sha256(data.read_bytes())
    }

    save_jsonl(data, second)
    before = checksums(run)
    swapped = run_cli("sweep", "--data", data, *common)
    assert swapped.returncode == 1
    assert (
        f"{data} changed since the run in {run} started: it has sha256 {_sha256(data.read_bytes())} now"
        in swapped.stderr
    )
    assert f"the run recorded sha256 {_sha256(original)}" in swapped.stderr
    assert (
        "Restore the file (or folder) the run started with to resume it, or write into a new folder"
        in swapped.stderr
    )
    assert checksums(run) == before

    elsewhere = tmp_path / "copy.jsonl"  # the first file's bytes at another path: the same data
    elsewhere.write_bytes(original)
    moved = run_cli("sweep", "--data", elsewhere, *common)
    assert moved.returncode == 0, moved.stderr[-2000:]
    assert "0 new" in moved.stdout
    other = run_cli("sweep", "--data", data, *common)  # another path and other bytes
    assert other.returncode == 1
    assert f"data: '../copy.jsonl' (sha256 {_sha256(original)}) there" in other.stderr
    assert f"'../data/questions.jsonl' (sha256 {_sha256(data.read_bytes())}) now" in other.stderr


def test_a_sweep_started_before_data_digests_checks_its_saved_examples_then_records_one(model_dir, tmp_path):
    data = tmp_path / "questions.jsonl"
    save_jsonl(data, generate_invented_qa(4, 3, seed=3))
    original = data.read_bytes()
    run = tmp_path / "run"
    command = ["sweep", "--data", data, "--out", run, "--model", model_dir, "--documents", "4"]
    command += ["--samples", "2", "--metrics", "loglik", "--no-progress", "--threads", "1"]
    assert run_cli(*command, "--methods", "none").returncode == 0
    manifest = json.loads((run / "manifest.json").read_text())
    del manifest["data"]  # as a version that did not record its data wrote it
    (run / "manifest.json").write_text(json.dumps(manifest))

    save_jsonl(data, generate_invented_qa(4, 3, seed=4))
    before = checksums(run)
    swapped = run_cli(*command, "--methods", "none")
    assert swapped.returncode == 1
    assert f"{data} no longer holds the examples this sweep saved in {run / 'examples.jsonl.gz'}" in (
        swapped.stderr
    )
    assert checksums(run) == before

    data.write_bytes(original)
    restored = run_cli(*command, "--methods", "none", "pi")
    assert restored.returncode == 0, restored.stderr[-2000:]
    assert f"{run} recorded no digest of {data} (sha256 {_sha256(original)})" in restored.stderr
    assert json.loads((run / "manifest.json").read_text())["data"] == {
        "../questions.jsonl": _sha256(original)
    }
    assert {r["method"] for r in read_records(run / "results.jsonl")} == {"none", "pi"}


def _search(model_dir: Path, data: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """`calibrate search` over two rungs of two questions; a budget so small that every run
    scores one batch and stops, so a rerun resumes."""
    options = ["--space", "mspoe", "--documents", "4", "--positions", "0,3", "--rungs", "2,2", "--keep", "1"]
    options += ["--budget-hours", "1e-9", "--model", model_dir, "--threads", "1", "--no-progress"]
    return run_cli("calibrate", "search", "--data", data, "--out", out, *options)


def test_a_resumed_search_refuses_another_data_file_and_resumes_from_a_clone(model_dir, tmp_path):
    data = tmp_path / "repo" / "data" / "questions.jsonl"
    data.parent.mkdir(parents=True)
    save_jsonl(data, generate_invented_qa(4, 6, seed=3))
    original = data.read_bytes()
    out = tmp_path / "repo" / "runs" / "search"
    started = _search(model_dir, data, out)
    assert started.returncode == 0, started.stderr[-2000:]
    assert json.loads((out / "search.json").read_text())["data_sha256"] == _sha256(original)

    save_jsonl(data, generate_invented_qa(4, 6, seed=4))
    before = checksums(out)
    swapped = _search(model_dir, data, out)
    assert swapped.returncode == 1
    assert (
        f"{data} (sha256 {_sha256(data.read_bytes())}) is not the data the search in {out} started on: "
        in (swapped.stderr)
    )
    assert f"{data} (sha256 {_sha256(original)}, the file at that path then)" in swapped.stderr
    assert (
        "rerun with the file it started on (restore it); to search on questions.jsonl, use a new --out"
        in (swapped.stderr)
    )
    assert checksums(out) == before

    data.write_bytes(original)
    (tmp_path / "repo").rename(tmp_path / "clone")  # the repository cloned elsewhere
    renamed = tmp_path / "clone" / "data" / "renamed.jsonl"
    (tmp_path / "clone" / "data" / "questions.jsonl").rename(renamed)
    resumed = _search(model_dir, renamed, tmp_path / "clone" / "runs" / "search")
    assert resumed.returncode == 0, resumed.stderr[-2000:]


def test_a_search_started_before_data_digests_checks_its_rungs_then_records_one(model_dir, tmp_path):
    data = tmp_path / "questions.jsonl"
    save_jsonl(data, generate_invented_qa(4, 6, seed=3))
    original = data.read_bytes()
    out = tmp_path / "search"
    assert _search(model_dir, data, out).returncode == 0
    saved = json.loads((out / "search.json").read_text())
    del saved["data_sha256"]  # as a version that kept only the path wrote it
    (out / "search.json").write_text(json.dumps(saved))

    save_jsonl(data, generate_invented_qa(4, 6, seed=4))
    before = checksums(out)
    swapped = _search(model_dir, data, out)
    assert swapped.returncode == 1
    assert f"{out / 'data' / 'rung-1.jsonl.gz'} holds the questions rung 1 ran on, and they are not " in (
        swapped.stderr
    )
    assert (
        f"questions 1-2 of {data} now: the file changed since the search in {out} started" in swapped.stderr
    )
    assert checksums(out) == before

    data.write_bytes(original)
    restored = _search(model_dir, data, out)
    assert restored.returncode == 0, restored.stderr[-2000:]
    assert f"recorded sha256 {_sha256(original)} of {data}" in restored.stderr
    assert json.loads((out / "search.json").read_text())["data_sha256"] == _sha256(original)
