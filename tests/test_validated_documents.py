"""A config's validated document counts: saved and loaded with it, checked when loaded, and a
warning, once per count, when the engine answers a prompt with another number of documents."""

from __future__ import annotations

import json
import warnings

import pytest
from eval_run_helpers import tiny_chat_model

from rag_mspoe import Uniform
from rag_mspoe import calibrated as calibrated_configs
from rag_mspoe.attention.reorder import CalibratedReorder
from rag_mspoe.engine import Engine
from rag_mspoe.methods import validated_documents
from rag_mspoe.methods.method_config import load_method
from rag_mspoe.methods.validated_documents import UnvalidatedDocumentCount


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(validated_documents, "_warned", set())


def _config_file(folder, config, counts):
    path = config.save(folder / "tiny-cal.json", base_model="tiny-cal")
    data = json.loads(path.read_text())
    data["validated_documents"] = counts
    path.write_text(json.dumps(data))
    return path


def test_counts_load_and_save_with_the_config(tmp_path):
    loaded = load_method(_config_file(tmp_path, Uniform(factor=1.5), [10, 5, 10]))
    assert loaded == Uniform(factor=1.5) and loaded.validated_documents == (5, 10)
    assert Uniform(factor=1.5).validated_documents is None  # a fact of one config, not of the class
    again = load_method(loaded.save(tmp_path / "again.json"))
    assert again.validated_documents == (5, 10)
    plain = Uniform(factor=1.5).save(tmp_path / "plain.json")
    assert "validated_documents" not in json.loads(plain.read_text())


@pytest.mark.parametrize("bad", [[], [0], ["10"], [True], 10, "10"])
def test_bad_counts_name_the_key_and_the_file(tmp_path, bad):
    path = _config_file(tmp_path, Uniform(factor=1.5), bad)
    with pytest.raises(ValueError, match=r"tiny-cal\.json: validated_documents must be a non-empty list"):
        load_method(path)


def _document_prompt(count):
    lines = [f"Document [{i + 1}](Title: Doc {i + 1}) Passage {i + 1} says {i * 7}." for i in range(count)]
    return "\n".join(lines) + "\n\nQuestion: what does passage one say?\nAnswer:"


@pytest.mark.parametrize("config", [Uniform(factor=1.25), CalibratedReorder(layers=[2, 3], strength=0.0)])
def test_engine_warns_once_per_unvalidated_count(tmp_path, monkeypatch, config):
    monkeypatch.setattr(calibrated_configs, "SEARCH_PATH", [tmp_path])
    _config_file(tmp_path, config, [3])
    model, tokenizer = tiny_chat_model()
    model._rag_mspoe_name = "tiny-cal"
    engine = Engine(model, tokenizer, method="calibrated")

    def warned(count):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.generate(_document_prompt(count), max_new_tokens=2)
        return [w for w in caught if issubclass(w.category, UnvalidatedDocumentCount)]

    assert warned(3) == []
    [warning] = warned(2)
    message = str(warning.message)
    assert "validated on prompts of 3 documents" in message and "this prompt has 2" in message
    assert "rag-mspoe sweep --model tiny-cal --documents 2" in message
    assert warned(2) == []  # once per count
    assert len(warned(4)) == 1
    # Without recorded counts nothing is said.
    assert Engine(model, tokenizer, method=config).generate(_document_prompt(2), max_new_tokens=2) is not None


def test_the_shipped_config_records_where_it_was_validated():
    from rag_mspoe.calibrated import calibrated_method

    for path in calibrated_configs.SEARCH_PATH[0].glob("*.json"):
        assert calibrated_method(path.stem).validated_documents, f"{path.name} records no validated_documents"
