"""A converted GGUF's 4-bit grids are found once and saved in the model cache beside it; later
loads read them back and quantise to the same layers; a folder outside the cache is never written."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file
from test_int4_grid import saved_on_grid

from rag_mspoe.models import file_grids
from rag_mspoe.models.file_grids import GRIDS_FILE
from rag_mspoe.models.model_cache import CACHE_ENV
from rag_mspoe.models.quantization import INT8_PROMPT_INT4, quantization_census, quantize_model
from rag_mspoe.models.weight_only import WeightOnlyLinear


@pytest.mark.parametrize("scheme", [INT8_PROMPT_INT4, "int4-exact"])
def test_grids_found_once_are_read_back_by_the_next_load(tmp_path, monkeypatch, scheme):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "gguf" / "tiny-0123"
    model = saved_on_grid(folder)
    first = quantize_model(copy.deepcopy(model), scheme, folder)
    assert (folder / GRIDS_FILE).is_file()

    def not_again(*args, **kwargs):
        raise AssertionError("a saved grid was found again")

    monkeypatch.setattr(file_grids, "int4_grid", not_again)
    again = quantize_model(copy.deepcopy(model), scheme, folder)
    assert quantization_census(again) == quantization_census(first)
    for (name, layer), twin in zip(first.named_modules(), again.modules(), strict=True):
        if isinstance(layer, WeightOnlyLinear) and layer.bits == 4:
            assert torch.equal(layer.packed, twin.packed) and torch.equal(layer.scales, twin.scales), name
    x = torch.randn(1, 3, model.config.hidden_size, dtype=torch.bfloat16)
    layer = "model.layers.0.self_attn.q_proj"
    with torch.inference_mode():
        assert torch.equal(first.get_submodule(layer)(x), again.get_submodule(layer)(x))


def test_a_folder_outside_the_cache_is_not_written_to(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    folder = tmp_path / "my-model"
    model = saved_on_grid(folder)
    before = sorted(p.name for p in folder.iterdir())
    quantized = quantize_model(copy.deepcopy(model), INT8_PROMPT_INT4, folder)
    assert quantization_census(quantized)["int4-decoding"]["layers"] > 0  # type: ignore[index]
    assert sorted(p.name for p in folder.iterdir()) == before


def test_grids_saved_by_another_version_are_found_again_and_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "gguf" / "tiny-0123"
    model = saved_on_grid(folder)
    expected = quantization_census(quantize_model(copy.deepcopy(model), INT8_PROMPT_INT4, folder))
    save_file(
        {"x.codes": torch.zeros(1, 1, dtype=torch.uint8)}, folder / GRIDS_FILE, metadata={"version": "0"}
    )
    again = quantize_model(copy.deepcopy(model), INT8_PROMPT_INT4, folder)
    assert quantization_census(again) == expected
    from safetensors import safe_open

    with safe_open(folder / GRIDS_FILE, "pt") as handle:
        assert handle.metadata()["version"] == file_grids._VERSION
        assert "x.codes" not in set(handle.keys())
