"""Every command that writes a run folder refuses one holding files it did not write, naming them
and the option that resolves it, and writes nothing there; a folder it wrote before is resumed.
Real `rag-mspoe` processes on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import checksums, run_cli
from eval_run_helpers import save_tiny_chat_model

from rag_mspoe.eval.data.loaders import save_jsonl
from rag_mspoe.eval.data.synthetic import generate_invented_qa
from rag_mspoe.files import LOCK_FILE, check_output_folder, folder_lock


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=4096)


def _sweep(model_dir: Path, out: Path, *more: str):
    options = ["--documents", "4", "--samples", "2", "--metrics", "loglik", "--methods", "none", *more]
    return run_cli("sweep", "--out", out, "--model", model_dir, *options, "--no-progress", "--threads", "1")


def _refused(result, folder: Path, *words: str) -> None:
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    for word in (str(folder), *words):
        assert word in result.stderr, (word, result.stderr[-2000:])


def test_a_sweep_refuses_a_folder_of_the_users_and_resumes_its_own(model_dir, tmp_path):
    users = tmp_path / "u"
    users.mkdir()
    (users / "table.md").write_text("NOTES")
    (users / "summary.json").write_text("{}")
    before = checksums(tmp_path)
    _refused(_sweep(model_dir, users), users, "summary.json, table.md", "--out")
    assert checksums(tmp_path) == before  # not even a lock file

    run = tmp_path / "run"
    assert _sweep(model_dir, run).returncode == 0
    resumed = _sweep(model_dir, run, "pi")  # its own folder: resumed with another method
    assert resumed.returncode == 0 and "(6 new)" in resumed.stdout, resumed.stderr[-2000:]

    (run / "manifest.json").write_text(json.dumps({"notes": "mine"}))
    _refused(_sweep(model_dir, run), run / "manifest.json", "not a run's manifest", "--out")


def test_a_first_sweep_killed_before_its_manifest_resumes(model_dir, tmp_path):
    run = tmp_path / "run"
    assert _sweep(model_dir, run).returncode == 0
    for path in run.iterdir():  # what a kill between the examples and the manifest leaves
        if path.name not in ("examples.jsonl.gz", LOCK_FILE):
            path.unlink()
    again = _sweep(model_dir, run)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "(6 new)" in again.stdout


def test_an_out_that_is_a_file_or_cannot_be_written_is_a_message(model_dir, tmp_path):
    existing = tmp_path / "file.txt"
    existing.write_text("mine")
    _refused(_sweep(model_dir, existing), existing, "is a file, not a folder", "--out")
    _refused(_sweep(model_dir, existing / "run"), existing / "run", "Cannot write into")
    assert existing.read_text() == "mine"


def test_reports_and_comparisons_write_only_into_their_own_folders(model_dir, tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    assert _sweep(model_dir, run).returncode == 0 and _sweep(model_dir, other).returncode == 0
    users = tmp_path / "u"
    users.mkdir()
    (users / "table.md").write_text("NOTES")
    before = checksums(tmp_path)
    _refused(run_cli("report", run, "--out", users), users, "table.md", "--out")
    _refused(run_cli("report", run, "--out", other), other, "holds another run", "--out")
    _refused(run_cli("compare", run, other, "--out", users), users, "table.md", "--out")
    assert checksums(tmp_path) == before

    reports = tmp_path / "reports"
    for _ in range(2):  # a report's folder is its own the second time
        assert run_cli("report", run, "--out", reports).returncode == 0
        assert run_cli("compare", run, other, "--out", reports / "vs").returncode == 0
    assert {p.name for p in reports.iterdir()} == {
        "summary.json",
        "table.md",
        "accuracy_by_position.png",
        "vs",
    }


def test_a_search_refuses_a_folder_of_the_users(model_dir, tmp_path):
    data = tmp_path / "questions.jsonl"
    save_jsonl(data, generate_invented_qa(4, 4, seed=3))
    users = tmp_path / "u"
    users.mkdir()
    (users / "notes.md").write_text("NOTES")
    before = checksums(users)
    options = ["--space", "mspoe", "--documents", "4", "--positions", "0,3", "--rungs", "2", "--keep", "1"]
    result = run_cli("calibrate", "search", "--data", data, "--out", users, "--model", model_dir, *options)
    _refused(result, users, "notes.md", "--out")
    assert checksums(users) == before


def test_the_folder_check_counts_the_lock_and_interrupted_writes_as_the_commands(tmp_path):
    (tmp_path / LOCK_FILE).write_text("")
    (tmp_path / ".summary.json.0123456789ab.tmp").write_text("")
    check_output_folder(tmp_path, "summary.json")
    (tmp_path / "summary.json").write_text("[]")
    with pytest.raises(ValueError, match=r"holds files this command did not write \(summary.json\)"):
        check_output_folder(tmp_path, "summary.json", is_ours=lambda path: path.read_text() != "[]")


@pytest.mark.skipif(
    not Path("/sys/kernel").is_dir(), reason="needs sysfs, where even root cannot create folders"
)
def test_a_folder_that_cannot_be_written_is_a_message_for_every_writer():
    with (
        pytest.raises(
            RuntimeError, match="Cannot write into /sys/rag-mspoe-run: .*choose a folder you can write to"
        ),
        folder_lock("/sys/rag-mspoe-run", "busy"),
    ):
        pass
