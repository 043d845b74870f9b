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
        (lambda d: _truncate(d / "vectors-000001.faiss"), "vectors-000001.faiss cannot be read ("),
    ],
    ids=[
        "torn-meta",
        "foreign-meta",
        "missing-chunk-store",
        "bad-chunk-line",
        "short-chunk-store",
        "torn-vectors",
    ],
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


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


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


def _tiny_embedding_model(folder: Path, seed: int) -> Path:
    """A one-layer random BERT with all-MiniLM-L6-v2's tokenizer: a real sentence-transformers model
    folder, 32-dimensional whatever the seed."""
    import shutil

    import torch
    from transformers import BertConfig, BertModel

    from rag_mspoe.pipelines.embedding import _packaged_default_dir

    packaged = _packaged_default_dir()
    assert packaged is not None
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=37, max_position_embeddings=256,
    )  # fmt: skip
    BertModel(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(packaged / name, folder / name)
    return folder


def test_another_embedding_model_at_the_same_path_is_refused(tmp_path):
    from rag_mspoe.pipelines.index import IndexMismatchError
    from rag_mspoe.pipelines.retrieval import Retriever

    model = _tiny_embedding_model(tmp_path / "model", seed=0)
    first = write_corpus(tmp_path / "first", {"a.txt": "The windmill of Tarsk grinds rye."})
    second = write_corpus(tmp_path / "second", {"b.txt": "The ferry Skua was built in 1964."})
    index_dir = tmp_path / "index"
    index_documents(first, index_dir, embedding_model=str(model), progress=False)
    assert ChunkIndex.load(index_dir).settings.embedding_files["model.safetensors"].startswith("sha256:")
    _tiny_embedding_model(model, seed=1)  # other weights, same dimension, same path
    before = checksums(index_dir)

    with pytest.raises(IndexMismatchError, match=f"{model / 'model.safetensors'} changed") as refused:
        index_documents(second, index_dir, embedding_model=str(model), progress=False)
    assert "Put the original files back at that path, or rebuild the index" in str(refused.value)
    with pytest.raises(IndexMismatchError, match="is not the one the index at"):
        Retriever.load(index_dir)
    assert checksums(index_dir) == before

    _tiny_embedding_model(model, seed=0)  # the original model back: searchable again
    assert Retriever.load(index_dir).retrieve("windmill", k=1)[0].chunk.text.startswith("The windmill")
    tokenizer_config = model / "tokenizer_config.json"
    lowered = tokenizer_config.read_text().replace('"do_lower_case": true', '"do_lower_case": false')
    tokenizer_config.write_text(lowered)
    with pytest.raises(IndexMismatchError, match=f"{tokenizer_config} changed"):
        Retriever.load(index_dir)  # the tokenizer counts as much as the weights


def test_an_index_with_only_the_older_fingerprint_is_checked_by_it_then_records_its_files(tmp_path):
    import json

    from rag_mspoe.pipelines.index import META_FILE, IndexMismatchError
    from rag_mspoe.pipelines.model_fingerprint import ModelFiles

    model = _tiny_embedding_model(tmp_path / "model", seed=0)
    index_dir = tmp_path / "index"
    index_documents(write_corpus(tmp_path / "a", {"a.txt": "Rye."}), index_dir, embedding_model=str(model))
    meta = json.loads((index_dir / META_FILE).read_text())
    del meta["settings"]["embedding_files"]  # as an older version wrote it: one hash, no files
    meta["settings"]["embedding_fingerprint"] = ModelFiles.of(model).legacy_fingerprint()
    (index_dir / META_FILE).write_text(json.dumps(meta))

    _tiny_embedding_model(model, seed=1)
    with pytest.raises(IndexMismatchError, match="its weight or tokenizer files changed"):
        index_documents(write_corpus(tmp_path / "b", {"b.txt": "Oats."}), index_dir, progress=False)
    _tiny_embedding_model(model, seed=0)
    index_documents(write_corpus(tmp_path / "c", {"c.txt": "Barley."}), index_dir, progress=False)
    assert ChunkIndex.load(index_dir).settings.embedding_files == ModelFiles.of(model).digests
    (model / "config.json").write_text((model / "config.json").read_text().replace('"gelu"', '"relu"'))
    with pytest.raises(IndexMismatchError, match=f"{model / 'config.json'} changed"):
        index_documents(write_corpus(tmp_path / "d", {"d.txt": "Spelt."}), index_dir, progress=False)


def _sentence_transformer(folder: Path) -> Path:
    """The tiny model as a full sentence-transformers folder: modules (Transformer, mean Pooling,
    Normalize), their configs and a model card."""
    import json

    _tiny_embedding_model(folder, seed=0)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 256, "do_lower_case": False})
    )
    (folder / "1_Pooling").mkdir()
    pooling = {
        "word_embedding_dimension": 32,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_cls_token": False,
    }
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (folder / "README.md").write_text("A tiny model.\n")
    return folder


def _edit_json(path: Path, **changes: object) -> None:
    import json

    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(
    ("file", "edit"),
    [
        ("1_Pooling/config.json", {"pooling_mode_mean_tokens": False, "pooling_mode_cls_token": True}),
        ("config.json", {"num_attention_heads": 4}),
        ("sentence_bert_config.json", {"max_seq_length": 4}),
    ],
)
def test_an_embedding_model_whose_configs_change_is_refused_naming_the_file(tmp_path, file, edit):
    from rag_mspoe.pipelines.index import IndexMismatchError
    from rag_mspoe.pipelines.retrieval import Retriever

    model = _sentence_transformer(tmp_path / "model")
    index_dir = tmp_path / "index"
    index_documents(write_corpus(tmp_path / "a", {"a.txt": "The windmill of Tarsk grinds rye."}), index_dir,
                    embedding_model=str(model), progress=False)  # fmt: skip
    original = (model / file).read_bytes()
    (model / "README.md").write_text("Documentation changes no vector.\n")
    assert Retriever.load(index_dir).retrieve("windmill", k=1)

    _edit_json(model / file, **edit)
    files = checksums(index_dir)
    with pytest.raises(IndexMismatchError, match=f"{model / file} changed") as refused:
        Retriever.load(index_dir)
    assert "Put the original files back at that path, or rebuild the index" in str(refused.value)
    with pytest.raises(IndexMismatchError, match=f"{model / file} changed"):
        index_documents(write_corpus(tmp_path / "b", {"b.txt": "Oats."}), index_dir, progress=False)
    assert checksums(index_dir) == files

    (model / file).write_bytes(original)
    assert Retriever.load(index_dir).retrieve("windmill", k=1)[0].chunk.text.startswith("The windmill")


def test_a_module_added_to_an_embedding_model_is_refused_naming_its_files(tmp_path):
    import json

    from rag_mspoe.pipelines.index import IndexMismatchError
    from rag_mspoe.pipelines.retrieval import Retriever

    model = _sentence_transformer(tmp_path / "model")
    index_dir = tmp_path / "index"
    index_documents(write_corpus(tmp_path / "a", {"a.txt": "Rye."}), index_dir, embedding_model=str(model))
    from sentence_transformers.models import Dense

    (model / "3_Dense").mkdir()
    Dense(32, 32).save(str(model / "3_Dense"))
    modules = json.loads((model / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (model / "modules.json").write_text(json.dumps(modules))

    with pytest.raises(IndexMismatchError) as refused:
        Retriever.load(index_dir)
    assert f"{model / 'modules.json'} changed" in str(refused.value)
    assert f"{model / '3_Dense' / 'config.json'} is new" in str(refused.value)


def test_a_link_inside_the_documents_to_a_file_outside_is_skipped_and_named(tmp_path):
    docs = write_corpus(tmp_path / "docs", {"inside.txt": "The windmill of Tarsk grinds rye."})
    secret = write_corpus(tmp_path / "private", {"secret.txt": "The vault code is 4417."}) / "secret.txt"
    (docs / "notes.txt").symlink_to(secret)
    (docs / "sub").mkdir()
    (docs / "sub" / "again.txt").symlink_to("../inside.txt")  # stays inside: read, once

    result = run_cli("index", docs, "--index", tmp_path / "index")

    assert result.returncode == 0, result.stderr
    assert f"notes.txt: a link to {secret.resolve()}, outside the documents folder" in result.stdout
    assert "--follow-links" in result.stdout
    indexed = ChunkIndex.load(tmp_path / "index").documents
    assert list(indexed) == [str((docs / "inside.txt").resolve())]

    followed = run_cli("index", docs, "--index", tmp_path / "all", "--follow-links")
    assert followed.returncode == 0, followed.stderr
    assert str(secret.resolve()) in ChunkIndex.load(tmp_path / "all").documents
