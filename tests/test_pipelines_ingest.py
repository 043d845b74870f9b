"""Reading documents: every format, skipped files counted with a reason, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from pipelines_helpers import CORPUS, write_corpus

from rag_mspoe.pipelines.ingest import load_documents


def _by_name(result):
    return {
        Path(doc.source).name + (f"#{doc.location}" if doc.location else ""): doc for doc in result.documents
    }


def test_reads_text_markdown_html_and_jsonl(tmp_path):
    result = load_documents(write_corpus(tmp_path / "docs"), progress=False)
    docs = _by_name(result)
    assert set(docs) == {
        "harbour.md",
        "bakery.txt",
        "observatory.html",
        "ferries.jsonl#line 1",
        "ferries.jsonl#line 2",
    }
    assert result.files_read == 4 and result.skipped == []
    # Plain text and Markdown keep the file's text exactly, so offsets point into the file.
    assert docs["harbour.md"].text == CORPUS["harbour.md"]
    assert docs["harbour.md"].title == "Harbour of Vossel"
    assert docs["bakery.txt"].title == "bakery"
    html = docs["observatory.html"]
    assert html.title == "Kelder Observatory"
    assert "mirror of 412 millimetres" in html.text
    assert "script text" not in html.text and "<p>" not in html.text
    assert docs["ferries.jsonl#line 2"].title == "Ferry Skua"
    assert docs["ferries.jsonl#line 2"].text.startswith("The ferry Skua")


def test_reads_a_pdf(tmp_path):
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_title("Tide Tables of Pell")
    pdf.add_page()
    pdf.set_font("Helvetica", size=12)
    pdf.multi_cell(0, 10, "The spring tide at Pell rises 5.2 metres above the chart datum.")
    pdf.add_page()
    pdf.multi_cell(0, 10, "The neap tide rises only 1.9 metres.")
    path = tmp_path / "tides.pdf"
    pdf.output(str(path))

    result = load_documents(path, progress=False)
    (doc,) = result.documents
    assert doc.title == "Tide Tables of Pell"
    assert "spring tide at Pell rises 5.2 metres" in doc.text
    assert "neap tide rises only 1.9 metres" in doc.text
    assert doc.text.index("spring") < doc.text.index("neap")


def test_unreadable_files_are_skipped_and_counted(tmp_path, caplog):
    folder = write_corpus(tmp_path / "docs", {"good.txt": "Readable text."})
    (folder / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (folder / "broken.pdf").write_bytes(b"%PDF-1.4 this is not really a pdf")
    (folder / "empty.md").write_text("   \n", encoding="utf-8")
    (folder / "picture.png").write_bytes(b"\x89PNG")
    (folder / "mixed.jsonl").write_text(
        '{"text": "kept"}\nnot json\n{"body": "no text field"}\n', encoding="utf-8"
    )

    result = load_documents(folder, progress=False)

    assert sorted(doc.text for doc in result.documents) == ["Readable text.", "kept"]
    reasons = {(Path(s.source).name, s.reason.split(" (")[0]) for s in result.skipped}
    assert ("latin1.txt", "not valid UTF-8") in reasons
    assert ("picture.png", "unsupported format '.png'") in reasons
    assert ("empty.md", "no text in the file") in reasons
    assert any(name == "broken.pdf" for name, _ in reasons)
    assert ("mixed.jsonl", "line 2: invalid JSON") in reasons
    assert ("mixed.jsonl", "line 3: no text in field 'text'") in reasons
    assert len(result.skipped) == 6
    assert "6 skipped" in result.summary()
    assert "latin1.txt" in caplog.text  # each skip is also a logged warning


def test_hidden_files_and_folders_are_not_read(tmp_path):
    folder = write_corpus(tmp_path / "docs", {"seen.txt": "visible"})
    write_corpus(folder / ".git", {"config.txt": "hidden folder"})
    (folder / ".notes.txt").write_text("hidden file", encoding="utf-8")
    result = load_documents(folder, progress=False)
    assert [doc.text for doc in result.documents] == ["visible"]


def test_empty_folder_and_missing_path_are_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="No files found in .*empty"):
        load_documents(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="nowhere does not exist"):
        load_documents(tmp_path / "nowhere")


def _pdf_bytes(text: str) -> bytes:
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_title("Tide Tables of Pell")
    pdf.add_page()
    pdf.set_font("Helvetica", size=12)
    pdf.multi_cell(0, 10, text)
    return bytes(pdf.output())


def test_a_parser_that_fails_in_any_way_skips_only_that_file(tmp_path):
    folder = write_corpus(tmp_path / "docs", {"good.txt": "Readable text."})
    # pypdf raises NotImplementedError (not one of its own errors) for an unknown stream filter.
    pdf = _pdf_bytes("The spring tide at Pell rises 5.2 metres.")
    (folder / "filter.pdf").write_bytes(pdf.replace(b"/FlateDecode", b"/FlateDecodX"))

    result = load_documents(folder, progress=False)

    assert [doc.text for doc in result.documents] == ["Readable text."]
    (skipped,) = result.skipped
    assert Path(skipped.source).name == "filter.pdf"
    assert skipped.reason == "the PDF reader failed (NotImplementedError: Unsupported filter /FlateDecodX)"


def test_links_that_loop_or_break_and_files_without_text_are_listed(tmp_path):
    folder = write_corpus(tmp_path / "docs", {"good.txt": "Readable text."})
    (folder / "nul.txt").write_bytes(b"\x00" * 64)
    (folder / "controls.md").write_text("\x01\x02\t\x0b\x7f\n", encoding="utf-8")
    (folder / "loop.txt").symlink_to("loop.txt")
    (folder / "broken.txt").symlink_to("nowhere.txt")
    (folder / "up").symlink_to(folder, target_is_directory=True)

    result = load_documents(folder, progress=False)

    assert [doc.text for doc in result.documents] == ["Readable text."]
    assert result.files_read == 1
    reasons = {Path(s.source).name: s.reason for s in result.skipped}
    assert reasons == {
        "nul.txt": "no text in the file",
        "controls.md": "no text in the file",
        "loop.txt": "a link that loops back on itself",
        "broken.txt": "a broken link (its target does not exist)",
        "up": "a link to a folder; not followed (index the folder by its own path)",
    }


def test_randomly_corrupted_pdfs_are_each_read_or_skipped_with_a_reason(tmp_path, caplog):
    import random

    from pipelines_helpers import embedder

    from rag_mspoe.pipelines.index import ChunkIndex
    from rag_mspoe.pipelines.indexing import index_documents

    valid = _pdf_bytes("The spring tide at Pell rises 5.2 metres above the chart datum.")
    rng = random.Random(16)  # 150 mutants; 5 of them make pypdf raise NotImplementedError
    folder = tmp_path / "fuzz"
    folder.mkdir()
    for number in range(150):
        mutant = bytearray(valid)
        for _ in range(rng.randint(1, 8)):
            mutant[rng.randrange(len(mutant))] = rng.randrange(256)
        (folder / f"mutant{number:03d}.pdf").write_bytes(bytes(mutant))

    report = index_documents(folder, tmp_path / "index", embedder=embedder(), progress=False)

    indexed = {Path(key).name for key in ChunkIndex.load(tmp_path / "index").documents}
    skipped = {Path(s.source).name: s.reason for s in report.skipped}
    assert report.documents_added == len(indexed) > 0
    assert not indexed & skipped.keys()
    assert indexed | skipped.keys() == {path.name for path in folder.iterdir()}
    assert all(reason.strip() for reason in skipped.values())
    assert sum("NotImplementedError" in reason for reason in skipped.values()) == 5
