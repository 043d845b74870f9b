"""Answers and gold-answer scores from one prefill per prompt (`Engine.generate_and_score`): the
answers of `generate_batch` and the scores of `score_prompts`, with each prompt read once; and a
sweep measuring both writes the records of measuring each apart."""

from __future__ import annotations

import pytest
import torch
from eval_run_helpers import embedded_tokenizer, tiny_chat_model
from test_joined_decode import PROMPTS, PrefillCounter, answers, prompt_ids, shared_starts
from tiny_models import tiny_model

from rag_mspoe.engine import Engine
from rag_mspoe.eval.runs.results import read_records
from rag_mspoe.eval.sweep.plan import SweepConfig
from rag_mspoe.eval.sweep.run import run_sweep

CONTINUATIONS = ["Paris", "The Danube, through ten countries"]
SETTINGS = {"max_new_tokens": 10, "stop": ["a"]}


@pytest.fixture(scope="module")
def engine():
    tokenizer = embedded_tokenizer()
    model = tiny_model(
        "llama", vocab_size=len(tokenizer), max_position_embeddings=2048, initializer_range=0.3
    )
    return Engine(model, tokenizer, name="tiny-llama")


def items_of(prompts):
    return [(prompt, CONTINUATIONS) for prompt in prompts]


def assert_same(together, answers_apart, scores_apart, tolerance):
    assert answers([answer for answer, _ in together]) == answers(answers_apart)
    for (_, scores), expected in zip(together, scores_apart, strict=True):
        assert [tokens for _, tokens in scores] == [tokens for _, tokens in expected]
        assert [total for total, _ in scores] == pytest.approx([t for t, _ in expected], abs=tolerance)


def test_answers_and_scores_come_from_one_prefill_per_prompt(engine):
    prompts = [*PROMPTS, PROMPTS[0]]  # a repeated prompt is read once
    answers_apart = engine.generate_batch(prompts, **SETTINGS)
    scores_apart = engine.score_prompts(items_of(prompts))
    counter = PrefillCounter(engine.model)
    try:
        together = engine.generate_and_score(items_of(prompts), **SETTINGS)
    finally:
        counter.remove()
    assert_same(together, answers_apart, scores_apart, tolerance=1e-4)
    # One forward per distinct prompt, of what follows the start it shares with an earlier one;
    # the rest are the continuations (one row each) and the decoding steps of the joined batch.
    ids = [prompt_ids(engine, prompt) for prompt in PROMPTS]
    lengths = sorted(len(row) - shared for row, shared in zip(ids, shared_starts(ids), strict=True))
    assert sorted(tokens for rows, tokens in counter.prefills() if rows == 1) == lengths
    assert all(rows in (1, len(CONTINUATIONS), len(PROMPTS)) for rows, _ in counter.calls)


@pytest.mark.parametrize("method", ["mspoe", "pine", "invariant-reorder"])
def test_every_method_gives_the_answers_and_scores_of_both_calls(engine, method):
    # Methods that hook the model score apart; a reordering's unmodified read shares its prefill.
    answers_apart = engine.generate_batch(PROMPTS, method=method, **SETTINGS)
    scores_apart = engine.score_prompts(items_of(PROMPTS), method=method)
    together = engine.generate_and_score(items_of(PROMPTS), method=method, **SETTINGS)
    assert_same(together, answers_apart, scores_apart, tolerance=1e-4)


def test_sampled_answers_and_a_prefix_still_score_as_asked(engine):
    prompts = PROMPTS[:2]
    scores_apart = engine.score_prompts(items_of(prompts))
    sampled = engine.generate_and_score(items_of(prompts), temperature=0.8, seed=3, max_new_tokens=6)
    assert answers([a for a, _ in sampled]) == answers(
        engine.generate_batch(prompts, temperature=0.8, seed=3, max_new_tokens=6)
    )
    prefixed = engine.generate_and_score(items_of(prompts), prefix="Answer:", max_new_tokens=6)
    for (_, scores), expected in zip([*sampled, *prefixed], [*scores_apart, *scores_apart], strict=True):
        assert [t for t, _ in scores] == pytest.approx([t for t, _ in expected], abs=1e-4)


def test_bad_items_are_refused(engine):
    with pytest.raises(TypeError, match="non-empty list"):
        engine.generate_and_score([])
    with pytest.raises(TypeError, match="continuations is a non-empty list"):
        engine.generate_and_score([(PROMPTS[0], "Paris")])


def test_a_sweep_measuring_answers_and_likelihoods_writes_the_records_of_each_apart(tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_MSPOE_CACHE", str(tmp_path / "cache"))
    model, tokenizer = tiny_chat_model()
    settings = dict(
        num_documents=4,
        positions=(0, 3),
        methods=("none", "mspoe", "invariant-reorder"),
        samples=3,
        batch_size=6,
        max_new_tokens=6,
    )
    for name, metrics in {
        "both": ("loglik", "generate"),
        "loglik": ("loglik",),
        "gen": ("generate",),
    }.items():
        config = SweepConfig(metrics=metrics, **settings)
        run_sweep(config, tmp_path / name, model=model, tokenizer=tokenizer, progress=False)

    def records(folder):
        found = read_records(tmp_path / folder / "results.jsonl")
        return {(r["method"], r["position"], r["example_id"]): r for r in found}

    both, loglik, generated = records("both"), records("loglik"), records("gen")
    assert len(both) == 3 * 2 * 3 and both.keys() == loglik.keys() == generated.keys()
    for key, record in both.items():
        assert (record["prediction"], record["match"]) == (
            generated[key]["prediction"],
            generated[key]["match"],
        )
        assert record["gold_tokens"] == loglik[key]["gold_tokens"]
        assert record["gold_logprob"] == pytest.approx(loglik[key]["gold_logprob"], abs=1e-4)


@pytest.mark.slow
def test_the_embedded_model_answers_and_scores_rag_prompts_as_both_calls_in_fp32():
    from rag_mspoe import load_model

    model, tokenizer = load_model(dtype=torch.float32)
    engine = Engine(model, tokenizer)
    settings = {"max_new_tokens": 16, "stop": ["\n"]}
    items = [(prompt, ["Paris", "Mont Blanc"]) for prompt in PROMPTS]
    together = engine.generate_and_score(items, **settings)
    assert_same(together, engine.generate_batch(PROMPTS, **settings), engine.score_prompts(items), 1e-3)
