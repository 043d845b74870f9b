"""Methods measured to lose on a model: every entry is what its run's records say, `rag-mspoe
models` lists it, and using the method on that model warns once."""

from __future__ import annotations

import math
import shutil
import warnings
from pathlib import Path

import pytest
from eval_run_helpers import tiny_chat_model

from rag_mspoe.calibrated import measured_losses as losses_module
from rag_mspoe.calibrated.measured_losses import (
    LOSSES_FOLDER,
    SIGNIFICANT,
    MeasuredLossWarning,
    measured_losses,
    warn_measured_loss,
)
from rag_mspoe.cli import main
from rag_mspoe.engine import Engine
from rag_mspoe.eval.e2e import write_e2e_report
from rag_mspoe.models.embedded_models import MODELS
from rag_mspoe.pipelines.answer import pack_for_engine
from rag_mspoe.pipelines.chunking import Chunk
from rag_mspoe.pipelines.retrieval import RetrievedChunk

ROOT = Path(__file__).resolve().parents[1]
LOSING_MODEL = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(autouse=True)
def warn_again(monkeypatch):
    monkeypatch.setattr(losses_module, "_warned", set())


def entries():
    return [
        (path.stem, loss)
        for path in sorted(LOSSES_FOLDER.glob("*.json"))
        for loss in measured_losses(path.stem)
    ]


def test_there_is_a_measured_loss_to_check():
    assert entries()


@pytest.mark.parametrize(("model", "loss"), entries(), ids=lambda value: getattr(value, "method", value))
def test_each_loss_is_what_its_records_say(tmp_path, model, loss):
    assert model in MODELS
    shutil.copy(ROOT / loss.run / "results.jsonl", tmp_path / "results.jsonl")
    measured = write_e2e_report(tmp_path)["overall"][loss.method]
    assert measured["n"] == loss.questions
    assert round(measured["accuracy"], 4) == loss.score
    assert round(measured["accuracy"] - measured["difference"], 4) == loss.baseline
    assert math.isclose(measured["p_vs_none"], loss.p, rel_tol=0.05)
    assert loss.score < loss.baseline and loss.p < SIGNIFICANT


def test_models_lists_the_losses(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    block = out.split(f"{LOSING_MODEL}:")[1].split("install:")[0]
    assert "measured to lose: longcontextreorder: 44.4 -> 22.2 % exact match" in block
    assert "p = 0.0004" in block


def test_longcontextreorder_in_the_pipeline_warns_once_on_a_model_it_hurts():
    retrieved = [
        RetrievedChunk(Chunk(f"{n}.txt", f"Doc {n}", f"Text of document {n}.", 0, 20), 1.0 - n / 10, n + 1, n)
        for n in range(4)
    ]
    model, tokenizer = tiny_chat_model()
    for name, warned in ((LOSING_MODEL, True), ("tiny-llama", False)):
        engine = Engine(model, tokenizer, name=name)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pack_for_engine("Which document?", retrieved, engine, reorder=True)
            pack_for_engine("Which document?", retrieved, engine, reorder=True)
            pack_for_engine("Which document?", retrieved, engine)
        messages = [str(w.message) for w in caught if issubclass(w.category, MeasuredLossWarning)]
        assert len(messages) == (1 if warned else 0)
        if warned:
            assert "-22.2 points" in messages[0] and "method='calibrated'" in messages[0]


def test_a_method_without_a_measured_loss_is_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_measured_loss(LOSING_MODEL, "calibrated")
        warn_measured_loss("no-such-model", "longcontextreorder")


def test_the_engine_warns_once_when_asked_for_a_method_measured_to_lose(tmp_path, monkeypatch):
    (tmp_path / "tiny-llama.json").write_text(
        '[{"method": "mspoe", "setting": "a test", "baseline": 0.5, "score": 0.25, "questions": 40, '
        '"p": 0.01, "run": "runs/none", "why": "a test says so"}]'
    )
    monkeypatch.setattr(losses_module, "LOSSES_FOLDER", tmp_path)
    measured_losses.cache_clear()
    try:
        engine = Engine(*tiny_chat_model(), name="tiny-llama")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for method in ("mspoe", "mspoe", "none"):
                engine.generate("Hello", method=method, max_new_tokens=1)
        messages = [str(w.message) for w in caught if issubclass(w.category, MeasuredLossWarning)]
        assert len(messages) == 1 and messages[0].startswith("mspoe was measured to lower tiny-llama's")
    finally:
        measured_losses.cache_clear()
