"""`calibrate ranking`: every layer band and bias strength of calibrated reordering scored from one pass."""

from __future__ import annotations

import json

import pytest
from eval_run_helpers import tiny_chat_model

from rag_mspoe.attention.reorder import CalibratedReorder, moved_slot
from rag_mspoe.calibration.ranking import RECORDS_FILE, layer_bands, study
from rag_mspoe.engine import Engine
from rag_mspoe.eval.data.records import with_gold_at
from rag_mspoe.eval.data.synthetic import generate_invented_qa
from rag_mspoe.eval.runs.results import read_records
from rag_mspoe.eval.sweep.batch_scorer import prompt_of


def test_layer_bands_are_every_run_of_whole_blocks():
    assert layer_bands(4, 2) == [(0, 2), (0, 4), (2, 4)]
    assert len(layer_bands(28, 8)) == 8 * 9 // 2


def test_the_study_scores_each_setting_as_the_method_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_MSPOE_CACHE", str(tmp_path / "cache"))
    engine = Engine(*tiny_chat_model(), method="none")
    examples = generate_invented_qa(4, 3, seed=2)
    positions = (0, 2, 3)
    study(engine, examples, positions, tmp_path / "study", blocks=2, strengths=(0.0, 1.0), progress=False)
    rows = json.loads((tmp_path / "study" / "ranking.json").read_text())
    assert len(rows) == 3 * 2  # bands (0-1, 0-3, 2-3) x strengths
    for row in rows:
        first, stop = row["layers"]
        method = CalibratedReorder(layers=list(range(first, stop)), strength=row["strength"])
        hits = {p: 0 for p in positions}
        for example in examples:
            for position in positions:
                prompt = prompt_of(with_gold_at(example, position))
                _, (reordered,) = engine.rewritten([prompt], method=method)
                hits[position] += moved_slot(prompt, reordered, position) == 0
        assert row["by_position"] == {str(p): pytest.approx(hits[p] / len(examples)) for p in positions}
        assert row["accuracy"] == pytest.approx(sum(hits.values()) / (len(examples) * len(positions)))
    # Resumed: the recorded prompts are not run again.
    recorded = read_records(tmp_path / "study" / RECORDS_FILE)
    assert len(recorded) == len(examples) * len(positions)
    again = Engine(engine.model, engine.tokenizer, method="none")
    study(again, examples, positions, tmp_path / "study", blocks=2, strengths=(0.0, 1.0), progress=False)
    assert again.document_prefixes.computed == 0
    assert read_records(tmp_path / "study" / RECORDS_FILE) == recorded
