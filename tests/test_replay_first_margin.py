"""benchmarks/replay_first_margin.py: a margin rule replayed from a sweep's records."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rag_mspoe.attention.reorder import CalibratedReorder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from replay_first_margin import prompts, replay  # noqa: E402

# Strength 0: relevance is raw attention, so no positional-bias estimate is needed.
CONFIG = CalibratedReorder(layers=[0, 1], strength=0.0)
# Per question, the attention the last rows gave each of 3 documents (two layers alike): question
# "a" ranks its first document top, "b" the third by a wide lead, "c" the second by a hair.
ATTENTION = {"a": [0.5, 0.3, 0.2], "b": [0.1, 0.1, 0.8], "c": [0.33, 0.34, 0.33]}


def write_run(folder: Path) -> Path:
    manifest = {
        "methods": {"calibrated": {"method": CONFIG.to_dict()}},
        "model": {"name": "replay-test-model", "num_layers": 2, "num_heads": 1},
        "sweep": {"num_documents": 3},
    }
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    lines = []
    for question, attention in ATTENTION.items():
        relevance = [value / sum(attention) for value in attention]
        order = CONFIG.order(relevance)
        for position in range(3):
            # The unmodified model right only with the gold first; the reordering right where it moved.
            lines.append(
                {
                    "method": "none",
                    "example_id": question,
                    "position": position,
                    "match": float(position == 0),
                }
            )
            moved = order != [0, 1, 2]
            lines.append(
                {
                    "method": "calibrated",
                    "example_id": question,
                    "position": position,
                    "match": float(moved),
                    "ranking_attention": [attention, attention],
                    "documents_read": order,
                }
            )
    (folder / "results.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def test_margin_zero_is_the_shipped_method_and_a_wide_margin_the_unmodified_model(tmp_path):
    positions, paired = prompts(write_run(tmp_path / "run"))
    assert positions == [0, 1, 2] and all(p["agrees"] for p in paired)
    shipped = replay(positions, paired, "first", 0.0)
    # Right where it moved (b, c), and as the unmodified model where it kept the order (a).
    assert shipped["variant"] == {0: 100.0, 1: round(200 / 3, 1), 2: round(200 / 3, 1)}
    assert shipped["moved_percent"] == {pos: round(200 / 3, 1) for pos in positions}  # b and c
    kept = replay(positions, paired, "first", 1.0)
    assert kept["variant"] == kept["none"] and kept["moved_percent"] == {pos: 0.0 for pos in positions}
    # A margin between c's hair and b's lead keeps c's order only.
    between = replay(positions, paired, "first", 0.1)
    assert between["moved_percent"] == {pos: round(100 / 3, 1) for pos in positions}
    assert replay(positions, paired, "runner-up", 0.1)["moved_percent"] == between["moved_percent"]


def test_a_prompt_whose_recorded_order_differs_is_left_out(tmp_path):
    folder = write_run(tmp_path / "run")
    lines = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
    lines[1]["documents_read"] = [1, 0, 2]  # question a at position 0: not the order its attention gives
    (folder / "results.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    positions, paired = prompts(folder)
    result = replay(positions, paired, "first", 0.0)
    assert result["left_out_disagreeing"] == 1 and result["questions"] == 2  # a is not complete
