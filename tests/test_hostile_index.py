"""`rag-mspoe index` and `search` against foreign, damaged and self-referencing folders, run as
real processes: each refusal names the file and the fix, and nothing outside the output changes."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import checksums, run_cli
from pipelines_helpers import embedder, write_corpus

from rag_mspoe.pipelines.index import ChunkIndex
from rag_mspoe.pipelines.indexing import index_documents


def _built_index(tmp_path: Path) -> tuple[Path, Path]:
    docs = write_corpus(tmp_path / "docs")
    index_dir = tmp_path / "index"
    index_documents(docs, index_dir, embedder=embedder(), progress=False)
    return docs, index_dir


def test_a_folder_of_the_users_own_files_is_refused_and_left_untouched(tmp_path):
    docs = write_corpus(tmp_path / "docs")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "chunks-2024.jsonl").write_text('{"text": "my notes"}\n')
    (mine / "vectors-7.faiss").write_bytes(b"my own vectors")
    (mine / "notes.txt").write_text("keep me")
    before = checksums(tmp_path)

    result = run_cli("index", docs, "--index", mine)

    assert result.returncode == 1
    assert f"{mine} is not empty and is not an index" in result.stderr
    assert "chunks-2024.jsonl" in result.stderr and "choose another --index folder" in result.stderr
    assert checksums(tmp_path) == before
    assert sorted(p.name for p in mine.iterdir()) == ["chunks-2024.jsonl", "notes.txt", "vectors-7.faiss"]


def test_an_index_whose_meta_json_is_missing_is_refused_not_overwritten(tmp_path):
    docs, index_dir = _built_index(tmp_path)
    (index_dir / "meta.json").unlink()
    write_corpus(docs, {"mill.txt": "The windmill of Tarsk grinds rye."})
    before = checksums(tmp_path)

    result = run_cli("index", docs, "--index", index_dir)

    assert result.returncode == 1
    assert f"{index_dir / 'meta.json'} is missing" in result.stderr
    assert "chunks-000001.jsonl" in result.stderr
    assert "restoring meta.json" in result.stderr and "rebuild it into a new folder" in result.stderr
    assert checksums(tmp_path) == before  # the 5 chunks are still there, byte for byte


def test_a_file_the_index_did_not_write_stops_a_writer_but_not_a_reader(tmp_path):
    docs, index_dir = _built_index(tmp_path)
    (index_dir / "chunks-2024.jsonl").write_text("mine\n")
    write_corpus(tmp_path / "more", {"mill.txt": "The windmill of Tarsk grinds rye."})
    before = checksums(tmp_path)

    result = run_cli("index", tmp_path / "more", "--index", index_dir)

    assert result.returncode == 1
    assert f"The index folder {index_dir} holds files the index did not write (chunks-2024.jsonl)" in (
        result.stderr
    )
    assert checksums(tmp_path) == before
    assert len(ChunkIndex.load(index_dir)) == 5


def test_indexing_a_folder_into_itself_is_refused_every_time(tmp_path):
    docs = write_corpus(tmp_path / "docs")
    before = checksums(tmp_path)
    for _ in range(2):
        result = run_cli("index", docs, "--index", docs)
        assert result.returncode == 1
        assert f"{docs} is not empty and is not an index" in result.stderr
    assert checksums(tmp_path) == before


def test_an_index_inside_the_documents_never_reads_its_own_files(tmp_path):
    docs = write_corpus(tmp_path / "docs")
    index_dir = docs / "index"
    first = index_documents(docs, index_dir, embedder=embedder(), progress=False)
    files = checksums(index_dir)

    again = index_documents(docs, index_dir, embedder=embedder(), progress=False)

    assert (first.total_chunks, again.documents_added, again.total_chunks) == (5, 0, 5)
    own = {Path(s.source).name for s in again.skipped if "never reads its own files" in s.reason}
    assert own == {"meta.json", "chunks-000001.jsonl", "vectors-000001.faiss"}
    assert checksums(index_dir) == files


def test_a_failed_first_run_leaves_no_folder_behind(tmp_path):
    docs = write_corpus(tmp_path / "docs")
    index_dir = tmp_path / "index"

    result = run_cli("index", docs, "--index", index_dir, "--chunk-size", "100000")

    assert result.returncode == 1
    assert "chunk size 100000 exceeds the" in result.stderr
    assert not index_dir.exists()


def test_a_folder_a_killed_run_left_holding_only_its_lock_is_used(tmp_path):
    docs = write_corpus(tmp_path / "docs")
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    (index_dir / ".lock").touch()  # what a first run killed before its first save leaves

    report = index_documents(docs, index_dir, embedder=embedder(), progress=False)

    assert report.total_chunks == 5 and len(ChunkIndex.load(index_dir)) == 5


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "meta.json").write_text('{"format": 1, "sett'), "meta.json is damaged"),
        (lambda d: (d / "meta.json").write_text("[1, 2]"), "meta.json is not the meta.json of an index"),
        (lambda d: (d / "chunks-000001.jsonl").unlink(), "chunks-000001.jsonl is missing, though"),
        (
            lambda d: _replace_line(d / "chunks-000001.jsonl", 4, "{not json"),
            "chunks-000001.jsonl, line 4: not a chunk record",
        ),
        (
            lambda d: _drop_last_line(d / "chunks-000001.jsonl"),
            "inconsistent: its files hold different numbers of chunks (meta.json 5, chunks-000001.jsonl 4",
        ),
    ],
    ids=["torn-meta", "foreign-meta", "missing-chunk-store", "bad-chunk-line", "short-chunk-store"],
)
def test_a_damaged_index_names_the_file_and_the_fix(tmp_path, damage, message):
    _, index_dir = _built_index(tmp_path)
    damage(index_dir)
    before = checksums(tmp_path)

    result = run_cli("search", "Who dredged the harbour?", "--index", index_dir)

    assert result.returncode == 1
    assert message in result.stderr and "rebuild" in result.stderr
    assert str(index_dir) in result.stderr
    assert "Traceback" not in result.stderr
    assert checksums(tmp_path) == before


def _replace_line(path: Path, number: int, text: str) -> None:
    lines = path.read_text().splitlines(keepends=True)
    lines[number - 1] = text + "\n"
    path.write_text("".join(lines))


def test_one_bad_file_never_stops_the_run_and_every_skip_is_listed(tmp_path):
    docs = write_corpus(tmp_path / "docs", {"good.txt": "The windmill of Tarsk grinds rye."})
    from fpdf import FPDF

    pdf = FPDF()
    pdf.add_page()
    pdf.set_font("Helvetica", size=12)
    pdf.multi_cell(0, 10, "The spring tide at Pell rises 5.2 metres.")
    (docs / "filter.pdf").write_bytes(bytes(pdf.output()).replace(b"/FlateDecode", b"/FlateDecodX"))
    (docs / "nul.txt").write_bytes(b"\x00" * 64)
    (docs / "replaced.txt").write_text("\ufffd\ufffd\ufffd", encoding="utf-8")  # no token survives
    (docs / "loop.txt").symlink_to("loop.txt")
    before = checksums(docs)

    result = run_cli("index", docs, "--index", tmp_path / "index")

    assert result.returncode == 0, result.stderr
    assert "Indexed 1 documents as 1 chunks" in result.stdout and "4 skipped" in result.stdout
    skipped = sorted(line.strip() for line in result.stdout.splitlines() if "skipped " in line)
    assert [line.split(":")[0].rsplit("/", 1)[-1] for line in skipped] == [
        "filter.pdf",
        "loop.txt",
        "nul.txt",
        "replaced.txt",
    ]
    assert "NotImplementedError: Unsupported filter /FlateDecodX" in result.stdout
    assert "replaced.txt: no text the embedding model can read" in result.stdout
    assert list(ChunkIndex.load(tmp_path / "index").documents) == [str((docs / "good.txt").resolve())]
    assert checksums(docs) == before


def _drop_last_line(path: Path) -> None:
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:-1]))
