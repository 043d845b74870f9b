"""PINE is position-invariant on the prompts the sweep builds: the documents are numbered by their
content, not their place, and each holds its own line break, so moving the gold moves nothing but
its place, which PINE does not read."""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
import torch
from eval_run_helpers import tiny_chat_model

from rag_mspoe.eval.data.prompts import qa_prompt_with_spans
from rag_mspoe.eval.data.records import with_gold_at
from rag_mspoe.eval.data.synthetic import generate_invented_qa
from rag_mspoe.eval.runs.results import read_records
from rag_mspoe.eval.sweep.plan import SweepConfig
from rag_mspoe.eval.sweep.run import run_sweep


def _documents(text: str, spans: list[tuple[int, int]]) -> list[str]:
    return [text[start:end] for start, end in spans]


def test_order_free_prompts_hold_the_same_documents_wherever_the_gold_stands():
    example = generate_invented_qa(5, 1, seed=2)[0]
    told = [qa_prompt_with_spans(with_gold_at(example, p), order_free=True) for p in range(5)]
    assert len({tuple(sorted(_documents(*prompt))) for prompt in told}) == 1
    assert all(document.endswith("\n") for document in _documents(*told[0]))
    numbered = [qa_prompt_with_spans(with_gold_at(example, p)) for p in range(5)]
    assert len({tuple(sorted(_documents(*prompt))) for prompt in numbered}) == 5  # numbers by place
    unnumbered = [re.sub(r"Document \[\d+\]", "", text) for text, _ in (told[0], numbered[0])]
    assert unnumbered[0] == unnumbered[1]  # the paper's layout; only the numbers differ


def _spread_by_example(records: list[dict], method: str) -> list[float]:
    scores: dict[str, list[float]] = defaultdict(list)
    for record in records:
        if record["method"] == method:
            scores[record["example_id"]].append(record["gold_logprob"])
    return [max(values) - min(values) for values in scores.values()]


def _sweep(model, tokenizer, folder) -> list[dict]:
    config = SweepConfig(
        num_documents=4, positions=(0, 1, 2, 3), methods=("none", "pine"), samples=3, metrics=("loglik",)
    )
    run_sweep(config, folder, model=model, tokenizer=tokenizer, progress=False, report=False)
    return read_records(folder / "results.jsonl")


def test_pine_is_position_invariant_in_the_sweep_a_tiny_model(tmp_path):
    records = _sweep(*tiny_chat_model(max_position_embeddings=4096), tmp_path)
    assert max(_spread_by_example(records, "none")) > 1e-3
    assert max(_spread_by_example(records, "pine")) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pine_is_position_invariant_in_the_sweep_of_the_embedded_model(embedded, dtype, tmp_path):
    model, tokenizer = embedded
    original = next(model.parameters()).dtype
    model.to(dtype)
    try:
        records = _sweep(model, tokenizer, tmp_path)
    finally:
        model.to(original)
    # Numbered by place, PINE's gold log-likelihood moved by up to 1.08 nats (none: 4.8).
    assert max(_spread_by_example(records, "none")) > 0.1
    assert max(_spread_by_example(records, "pine")) < 1e-3
