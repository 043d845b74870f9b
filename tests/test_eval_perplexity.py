"""Perplexity against length: correct values, RoPE types inside and beyond the window, resuming."""

from __future__ import annotations

import math

import pytest
import torch
from eval_run_helpers import tiny_chat_model

from rag_mspoe.eval.perplexity import PerplexityConfig, run_perplexity
from rag_mspoe.eval.runs.results import read_records

WINDOW = 48  # the tiny model's trained context


@pytest.fixture(scope="module")
def tiny():
    return tiny_chat_model(max_position_embeddings=WINDOW)


@pytest.fixture()
def text_file(tmp_path):
    words = [
        "the",
        "harbour",
        "of",
        "vossel",
        "was",
        "dredged",
        "in",
        "1787",
        "by",
        "the",
        "engineer",
        "tilda",
        "marsk",
        "and",
        "her",
        "crew",
    ]
    path = tmp_path / "text.txt"
    path.write_text(" ".join(words[(i * 7) % len(words)] for i in range(600)))
    return path


def records_by(folder):
    return {(r["method"], r["length"], r["window"]): r for r in read_records(folder / "results.jsonl")}


def test_perplexity_table_for_pi_and_dynamic_ntk_with_and_without_layer_factors(tiny, text_file, tmp_path):
    methods = ("none", "pi:2", "dynamic-ntk:2", "layerwise+pi:2", "layerwise+dynamic-ntk:2")
    config = PerplexityConfig(text=str(text_file), lengths=(32, 96), methods=methods, windows=2)
    run = tmp_path / "run"  # beside the text, not around it
    summary = run_perplexity(config, run, model=tiny[0], tokenizer=tiny[1], progress=False)
    records = records_by(run)
    assert len(records) == len(methods) * 2 * 2
    table = summary["perplexity"]
    assert set(table) == set(methods) and all(set(row) == {32, 96} for row in table.values())
    # Dynamic NTK rescales only beyond the trained window.
    assert table["dynamic-ntk:2"][32] == table["none"][32]
    assert table["dynamic-ntk:2"][96] != table["none"][96]
    assert table["pi:2"][32] != table["none"][32]
    assert table["layerwise+pi:2"][32] != table["pi:2"][32]
    assert "| layerwise+dynamic-ntk:2 |" in (run / "table.md").read_text()
    assert (run / "perplexity_by_length.png").read_bytes().startswith(b"\x89PNG")

    # Each window's value is the model's own mean token loss over it.
    model, tokenizer = tiny
    ids = tokenizer(text_file.read_text(), add_special_tokens=False)["input_ids"][32:64]
    with torch.no_grad():
        loss = model(torch.tensor([ids]), labels=torch.tensor([ids])).loss
    assert records[("none", 32, 1)]["perplexity"] == pytest.approx(math.exp(float(loss)), rel=1e-4)

    again = run_perplexity(config, run, model=model, tokenizer=tokenizer, progress=False)
    assert again["perplexity"] == table and len(read_records(run / "results.jsonl")) == len(records)


def test_text_too_short_and_prompt_orders_are_refused(tiny, text_file, tmp_path):
    config = PerplexityConfig(text=str(text_file), lengths=(4000,), methods=("none",))
    with pytest.raises(ValueError, match="4000 are needed"):
        run_perplexity(config, tmp_path / "a", model=tiny[0], tokenizer=tiny[1], progress=False)
    config = PerplexityConfig(text=str(text_file), lengths=(32,), methods=("longcontextreorder",))
    with pytest.raises(ValueError, match="means nothing for perplexity"):
        run_perplexity(config, tmp_path / "b", model=tiny[0], tokenizer=tiny[1], progress=False)
