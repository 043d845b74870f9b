"""The moved-rows probe (benchmarks/probe_moved_rows.py) builds the rows it claims: the unmodified
model's rows moved to the new order with their keys rotated to their new positions, and with
fresh_first the moved document's rows those of a whole read of the new order."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rag_mspoe.attention.reorder import CalibratedReorder
from rag_mspoe.prompts.qa_prompt import render_qa_prompt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from probe_moved_rows import moved_rows, summary  # noqa: E402

DOCUMENTS = [
    ("Rivers", "The Danube flows through ten countries before it reaches the Black Sea."),
    ("France", "Paris is the capital of France and its largest city."),
    ("Mountains", "Mont Blanc is the highest mountain in the Alps, on the border of France and Italy."),
    ("Moons", "Titan is the largest moon of Saturn."),
]
ORDER = [2, 0, 1, 3]


@pytest.fixture(scope="module")
def prompt_rows(tiny_engine):
    prompt = render_qa_prompt("Which is the highest mountain in the Alps?", DOCUMENTS)[0]
    ids, spans = tiny_engine.document_spans_of(CalibratedReorder(), prompt)
    tiny_engine.document_prefixes.clear()
    return ids, spans


def whole_read(engine, ids):
    with torch.inference_mode():
        out = engine.model(torch.tensor([ids]), use_cache=True)
    return out.past_key_values


def test_moved_rows_are_the_old_rows_moved_with_their_keys_rotated(tiny_engine, prompt_rows):
    ids, spans = prompt_rows
    end = spans[-1][1]
    moved_ids, cache = moved_rows(tiny_engine, ids, spans, ORDER, fresh_first=False)
    assert sorted(moved_ids[:end]) == sorted(ids[:end]) and moved_ids[:end] != ids[:end]
    assert moved_ids[end:] == ids[end:]
    whole = whole_read(tiny_engine, moved_ids[:end])
    # The first layer's keys and values depend on a token and its position only: the moved and
    # rotated rows are a whole read's there; above it the rows saw the old order.
    torch.testing.assert_close(cache.layers[0].keys, whole.layers[0].keys, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cache.layers[0].values, whole.layers[0].values)
    assert not torch.allclose(cache.layers[-1].keys, whole.layers[-1].keys, atol=1e-3)


def test_fresh_first_reads_the_moved_document_as_a_whole_read_does(tiny_engine, prompt_rows):
    ids, spans = prompt_rows
    moved_ids, cache = moved_rows(tiny_engine, ids, spans, ORDER, fresh_first=True)
    whole = whole_read(tiny_engine, moved_ids[: spans[-1][1]])
    first_end = spans[0][0] + spans[ORDER[0]][1] - spans[ORDER[0]][0]
    for ours, theirs in zip(cache.layers, whole.layers, strict=True):
        assert ours.keys.shape == theirs.keys.shape
        torch.testing.assert_close(ours.keys[:, :, :first_end], theirs.keys[:, :, :first_end])
        torch.testing.assert_close(ours.values[:, :, :first_end], theirs.values[:, :, :first_end])


def test_the_summary_pairs_each_variant_with_the_shipped_read():
    def record(moved, **right):
        answers = {
            name: f"{name} {int(right.get(name, 0))}"
            for name in ("none", "exact", "kept_numbers", "reuse", "fresh_first")
        }
        return {"moved": moved, **answers, **{f"em_{name}": float(right.get(name, 0)) for name in answers}}

    records = [record(True, exact=1, kept_numbers=1), record(True, reuse=1), record(False, none=1, exact=1)]
    result = summary(records)
    assert result["questions"] == 3 and result["moved"] == 2
    assert result["exact"]["right_where_moved"] == 1
    assert result["reuse"]["right_only_here_or_in_exact"] == [1, 1]
    assert result["kept_numbers"]["right_only_here_or_in_exact"] == [0, 0]
    assert result["none"]["exact_match"] == pytest.approx(1 / 3, abs=1e-3)
