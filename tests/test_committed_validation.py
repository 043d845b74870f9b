"""The compact validation a shipped config carries, built from a run folder as `rag-mspoe sweep`
writes it: a run that scored exact match only (`--metrics generate`) gives a validation, a
curve and a verdict on exact match alone, and a run that scored both keeps both."""

from __future__ import annotations

import gzip
import json

import pytest

from rag_mspoe import calibrated as calibrated_configs
from rag_mspoe.attention.invariant_reorder import InvariantReorder
from rag_mspoe.calibrated.validation import (
    BASELINE,
    SHIPPED,
    ValidationRun,
    build_validation,
    validation_metrics,
    validation_records,
)
from rag_mspoe.eval.demo_curve import PLOTS, committed_curve
from rag_mspoe.eval.shipping_rule import wins

MODEL = "tiny-shipped"
LABEL = "keep-first"
CONFIG = InvariantReorder(score="question+judge", first_margin=0.0)
POSITIONS = (0, 4, 9)
QUESTIONS = 40


def _run_folder(tmp_path, *, loglik: bool):
    """A run folder of 40 questions: the unmodified model right on the first position only, the
    method right everywhere but on 4 questions; with the gold log-likelihood when `loglik`."""
    folder = tmp_path / "run"
    folder.mkdir()
    manifest = {
        "sweep": {
            "num_documents": 10,
            "positions": list(POSITIONS),
            "data": "validation-10.jsonl.gz",
            "max_new_tokens": 64,
        },
        "methods": {
            "none": {"name": "none", "method": None},
            LABEL: {"name": LABEL, "method": json.loads(json.dumps(CONFIG.to_dict()))},
        },
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with gzip.open(folder / "results.jsonl.gz", "wt") as handle:
        for question in range(QUESTIONS):
            for position in POSITIONS:
                for method in ("none", LABEL):
                    right = position == 0 if method == "none" else question >= 4
                    record = {
                        "method": method,
                        "position": position,
                        "example_id": str(question),
                        "match": float(right),
                        "seconds": 1.0,
                    }
                    if loglik:
                        record["gold_logprob"] = -1.0 if right else -5.0
                    handle.write(json.dumps(record) + "\n")
        # A question the method never reached: not paired, so left out.
        unpaired = {"method": "none", "position": 0, "example_id": "99", "match": 1.0, "seconds": 1.0}
        handle.write(json.dumps(unpaired) + "\n")
    return folder


@pytest.fixture
def shipped_config(tmp_path, monkeypatch):
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    CONFIG.save(shipped / f"{MODEL}.json", base_model=MODEL)
    monkeypatch.setattr(calibrated_configs, "SEARCH_PATH", [shipped])


def _validation(tmp_path, *, loglik: bool):
    _run_folder(tmp_path, loglik=loglik)
    run = ValidationRun(model=MODEL, folder="run", label=LABEL, command="rag-mspoe sweep")
    return build_validation(tmp_path, run)


def test_a_run_that_scored_exact_match_alone_gives_an_exact_match_validation(tmp_path, shipped_config):
    validation = _validation(tmp_path, loglik=False)
    assert validation_metrics(validation) == ["match"]
    assert validation["questions"] == [str(q) for q in range(QUESTIONS)]
    assert validation["scores"][BASELINE]["match"]["4"] == "0" * QUESTIONS
    assert validation["scores"][SHIPPED]["match"]["9"] == "0000" + "1" * (QUESTIONS - 4)
    assert all("gold_logprob" not in record for record in validation_records(validation))
    assert wins(validation)

    text = committed_curve(validation, tmp_path)
    assert "exact match (%)" in text and "log-likelihood (nats)" not in text
    assert "sign-flip" not in text
    assert (tmp_path / PLOTS["match"]).is_file() and not (tmp_path / PLOTS["gold_logprob"]).exists()


def test_a_run_that_scored_both_keeps_both(tmp_path, shipped_config):
    validation = _validation(tmp_path, loglik=True)
    assert validation_metrics(validation) == ["match", "gold_logprob"]
    assert validation["scores"][SHIPPED]["gold_logprob"]["0"][:5] == [-5.0, -5.0, -5.0, -5.0, -1.0]
    text = committed_curve(validation, tmp_path)
    assert "gold answer log-likelihood (nats)" in text and "sign-flip" in text
    assert all((tmp_path / name).is_file() for name in PLOTS.values())


def test_a_run_of_another_config_is_refused(tmp_path, shipped_config):
    folder = _run_folder(tmp_path, loglik=False)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["methods"][LABEL]["method"]["first_margin"] = None
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="not the config shipped"):
        build_validation(tmp_path, ValidationRun(model=MODEL, folder="run", label=LABEL, command=""))
