"""`calibrate ranking`: every layer band and bias strength of calibrated reordering scored from one pass."""

from __future__ import annotations

import dataclasses
import json

import pytest
from eval_run_helpers import tiny_chat_model

from rag_mspoe.attention.reorder import CalibratedReorder, moved_slot
from rag_mspoe.engine import Engine
from rag_mspoe.eval.data.records import with_gold_at
from rag_mspoe.eval.data.synthetic import generate_invented_qa
from rag_mspoe.eval.runs.results import read_records
from rag_mspoe.eval.settings_search.ranking import RECORDS_FILE, layer_bands, study
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
    # Other prompts under the same ids (another data file or document count), or another model:
    # refused before any record is added.
    other = [dataclasses.replace(example, question=example.question + " Be brief.") for example in examples]
    with pytest.raises(ValueError, match=r"recorded other prompts under the ids \['\S+', "):
        study(again, other, positions, tmp_path / "study", blocks=2, strengths=(0.0,), progress=False)
    renamed = Engine(engine.model, engine.tokenizer, method="none", name="another-model")
    with pytest.raises(ValueError, match="holds the attention of 'tiny-llama', not of 'another-model'"):
        study(renamed, examples, positions, tmp_path / "study", blocks=2, strengths=(0.0,), progress=False)
    assert read_records(tmp_path / "study" / RECORDS_FILE) == recorded


def test_the_command_writes_the_table_and_a_config_only_for_a_better_ranking(tmp_path, monkeypatch, capsys):
    from eval_run_helpers import save_tiny_chat_model

    from rag_mspoe.cli import main
    from rag_mspoe.eval.data.loaders import save_jsonl

    monkeypatch.setenv("RAG_MSPOE_CACHE", str(tmp_path / "cache"))
    model_dir = save_tiny_chat_model(tmp_path / "tiny")
    data = tmp_path / "questions.jsonl"
    save_jsonl(data, generate_invented_qa(4, 3, seed=5))
    out = tmp_path / "study"
    args = ["calibrate", "ranking", "--model", str(model_dir), "--data", str(data), "--documents", "4"]
    assert main([*args, "--positions", "0,3", "--samples", "3", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    rows = json.loads((out / "ranking.json").read_text())
    assert "| layers | strength | all |" in printed and (out / "ranking.md").is_file()
    default = next(row for row in rows if row["layers"] == [2, 4] and row["strength"] == 1.0)
    if rows[0]["accuracy"] > default["accuracy"] and rows[0]["p_vs_default"] < 0.05:
        saved = json.loads((out / "rag_mspoe_method.json").read_text())
        assert saved["layers"] == list(range(*rows[0]["layers"])) and saved["strength"] == rows[0]["strength"]
    else:
        assert not (out / "rag_mspoe_method.json").exists() and "no config written" in printed


def test_a_setting_that_ranks_better_on_the_same_prompts_is_significant():
    import torch

    from rag_mspoe.eval.settings_search.ranking import RankingSetting, accuracy_table

    def record(gold, decoy):
        # Layers 0-1 attend to the gold document, layers 2-3 to a decoy.
        def peak(at):
            return [1.0 if k == at else 0.0 for k in range(3)]

        return {"example_id": f"{gold}", "position": gold, "attention": [peak(gold)] * 2 + [peak(decoy)] * 2}

    records = [record(gold, (gold + 1) % 3) for gold in range(3)] * 4
    lower, upper = RankingSetting(0, 2, 0.0), RankingSetting(2, 4, 0.0)
    rows = accuracy_table(records, torch.zeros(4, 3), [lower, upper], default=upper)
    assert [row["setting"] for row in rows] == [lower, upper]
    assert rows[0]["accuracy"] == 1.0 and rows[0]["by_position"] == {0: 1.0, 1: 1.0, 2: 1.0}
    assert rows[1]["accuracy"] == 0.0 and rows[1]["p_vs_default"] == 1.0
    assert rows[0]["p_vs_default"] < 0.001
