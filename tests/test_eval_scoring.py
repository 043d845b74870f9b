"""Scoring with the engine: the batched one-prefill scorer against a slow one-forward-per-option
reference (fp32 tiny model, every method), forced choice, gold log-likelihood, greedy answers
scored by the paper's metrics, and a check on the real embedded model."""

from __future__ import annotations

import dataclasses
import math

import pytest
from scoring_reference import reference_loglikelihood
from tiny_models import tiny_model

from rag_mspoe.engine import Engine
from rag_mspoe.eval.data.prompts import kv_prompt, qa_prompt
from rag_mspoe.eval.data.records import with_gold_at
from rag_mspoe.eval.data.synthetic import generate_invented_qa, generate_kv
from rag_mspoe.eval.scoring.metrics import best_subspan_em, kv_match
from rag_mspoe.eval.scoring.model_scores import score_forced_choice, score_generation, score_loglikelihood
from rag_mspoe.prompts.chat_template import render

METHODS = [None, "mspoe", "mspoe-query-head", "layerwise"]


@pytest.fixture(scope="module")
def tokenizer(embedded):
    return embedded[1]


@pytest.fixture(scope="module")
def engine(tokenizer):
    # Large random weights give sharp attention, so a wrong position or ranking shows in the scores.
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=512, initializer_range=0.3)
    return Engine(model, tokenizer, name="tiny-llama")


@pytest.fixture(scope="module")
def example():
    return generate_invented_qa(3, 1, seed=2)[0]


def expected_token_counts(engine, prompt, continuations, *, raw=False, prefix=""):
    """Tokens the slow scorer scores: from where the continuation first changes the prompt's tokens."""
    context = render(engine.tokenizer, prompt, raw=raw, prefix=prefix)
    counts = []
    for text in continuations:
        ids = render(engine.tokenizer, prompt, raw=raw, prefix=prefix + text)
        start = next((i for i, (a, b) in enumerate(zip(context, ids, strict=False)) if a != b), len(context))
        counts.append(len(ids) - max(start, 1))
    return counts


@pytest.mark.parametrize("method", METHODS)
def test_fast_scores_equal_the_slow_ones(engine, example, method):
    prompt = qa_prompt(example)
    options = list(example.candidates) + ["a much longer answer than the others, with a comma"]
    fast = engine.score_continuations(prompt, options, method=method)
    slow = reference_loglikelihood(engine, prompt, options, method=method)
    assert [total for total, _ in fast] == pytest.approx(slow, abs=2e-4, rel=1e-5)
    assert [count for _, count in fast] == expected_token_counts(engine, prompt, options)
    assert len({round(total, 3) for total, _ in fast}) == len(options)  # the options really differ


@pytest.mark.parametrize("method", [None, "mspoe"])
def test_continuations_that_merge_with_the_prompt_end(engine, example, method):
    # "Hello wor" + "ld" re-tokenizes the prompt's last token; so does a newline after the template's.
    raw_prompt = qa_prompt(example) + " Hello wor"
    raw_options = ["ld", "k", "ld, and goodbye"]
    fast = engine.score_continuations(raw_prompt, raw_options, raw=True, method=method)
    slow = reference_loglikelihood(engine, raw_prompt, raw_options, raw=True, method=method)
    assert [total for total, _ in fast] == pytest.approx(slow, abs=2e-4, rel=1e-5)
    assert [n for _, n in fast] == expected_token_counts(engine, raw_prompt, raw_options, raw=True)
    chat_options = ["\n\nhi", "Par", " Paris"]
    fast = engine.score_continuations("Say hi", chat_options, prefix="The answer is", method=method)
    slow = reference_loglikelihood(engine, "Say hi", chat_options, prefix="The answer is", method=method)
    assert [total for total, _ in fast] == pytest.approx(slow, abs=2e-4, rel=1e-5)
    counts = expected_token_counts(engine, "Say hi", chat_options, prefix="The answer is")
    assert [n for _, n in fast] == counts


def test_forced_choice_picks_the_best_mean_per_token(engine, example):
    prompt = qa_prompt(example)
    options = list(example.candidates)
    gold = example.answers[0]
    result = score_forced_choice(engine, prompt, options, gold, method="mspoe")
    sums = reference_loglikelihood(engine, prompt, options, method="mspoe")
    counts = expected_token_counts(engine, prompt, options)
    means = {o: s / n for o, s, n in zip(options, sums, counts, strict=True)}
    assert result["scores"] == pytest.approx(means, abs=1e-4)
    assert result["choice"] == max(means, key=means.__getitem__)
    assert result["correct"] == (1.0 if result["choice"] == gold else 0.0)
    assert result["gold_sum"] == pytest.approx(sums[options.index(gold)], abs=2e-4)
    assert result["gold_tokens"] == counts[options.index(gold)]
    softmax = {o: math.exp(m) for o, m in means.items()}
    assert result["gold_share"] == pytest.approx(softmax[gold] / sum(softmax.values()), abs=1e-4)
    # Forcing the other way: the gold chosen exactly when it scores best.
    loser = min(means, key=means.__getitem__)
    assert score_forced_choice(engine, prompt, options, loser, method="mspoe")["correct"] == 0.0


def test_forced_choice_argument_errors(engine):
    with pytest.raises(ValueError, match="not among the candidates"):
        score_forced_choice(engine, "q", ["a", "b"], "c", method=None)
    with pytest.raises(ValueError, match="distinct non-empty"):
        score_forced_choice(engine, "q", ["a", "a"], "a", method=None)


def test_gold_loglikelihood(engine, example):
    prompt = qa_prompt(example)
    answer = example.answers[0]
    result = score_loglikelihood(engine, prompt, answer, method="layerwise")
    (slow,) = reference_loglikelihood(engine, prompt, [answer], method="layerwise")
    (count,) = expected_token_counts(engine, prompt, [answer])
    assert result["sum"] == pytest.approx(slow, abs=2e-4)
    assert result["tokens"] == count
    assert result["mean"] == pytest.approx(slow / count, abs=1e-4)
    with pytest.raises(ValueError, match="empty"):
        score_loglikelihood(engine, prompt, "", method=None)


def test_generation_is_scored_by_the_papers_metrics(engine):
    qa = generate_invented_qa(2, 3, seed=6)
    kv = generate_kv(3, 1, seed=6, short_keys=True)
    prompts = [qa_prompt(e) for e in qa] + [kv_prompt(e) for e in kv]
    full = [r.text for r in engine.generate_batch(prompts, max_new_tokens=12)]
    # Gold answers made from what the model wrote (a random model answers nothing right): the
    # last word of the first line, a phrase it never wrote, its last three characters (KV).
    first_lines = [text.split("\n")[0] for text in full]
    examples = [
        dataclasses.replace(qa[0], answers=((first_lines[0].split() or ["zzz"])[-1],), candidates=()),
        dataclasses.replace(qa[1], answers=("not in the answer",), candidates=()),
        dataclasses.replace(qa[2], answers=((first_lines[2].split() or ["zzz"])[0],), candidates=()),
    ]
    kv_pairs = kv[0].pairs[:-1] + ((kv[0].pairs[-1][0], full[3][-3:]),)
    examples.append(dataclasses.replace(kv[0], pairs=kv_pairs, key=kv_pairs[-1][0], value=kv_pairs[-1][1]))

    qa_only = score_generation(
        engine, prompts[:3], examples[:3], method=None, max_new_tokens=12, batch_size=2
    )
    for result, text, ex in zip(qa_only, full, examples, strict=False):
        assert result["prediction"] == text.split("\n")[0]  # generation stopped at the first newline
        assert result["correct"] == best_subspan_em(text, ex.answers)
    assert [r["correct"] for r in qa_only] == [float(bool(first_lines[0].split())), 0.0, 1.0]

    mixed = score_generation(engine, prompts, examples, method=None, max_new_tokens=12, batch_size=4)
    assert mixed[3]["prediction"] == full[3]  # KV answers count whole, so that batch did not stop early
    assert mixed[3]["correct"] == kv_match(full[3], examples[3].value) == 1.0
    with pytest.raises(ValueError, match="one prompt per example"):
        score_generation(engine, prompts[:2], examples, method=None)


def test_real_model_scores_the_context_and_agrees_with_the_slow_path(embedded):
    model, tokenizer = embedded
    engine = Engine(model, tokenizer)
    gains = []
    for example in generate_invented_qa(5, 2, seed=8, distractor_similarity=0.0):
        gold = example.answers[0]
        first = with_gold_at(example, 0)
        closed_book = dataclasses.replace(first, documents=first.documents[1:])
        with_context = score_loglikelihood(engine, qa_prompt(first), gold, method=None)["sum"]
        without = score_loglikelihood(engine, qa_prompt(closed_book), gold, method=None)["sum"]
        gains.append(with_context - without)
    # The invented answer is only guessable from the gold document, in nats per example.
    assert min(gains) > 2.0, gains
    options = list(first.candidates[:3])
    fast = engine.score_continuations(qa_prompt(first), options, method="mspoe")
    slow = reference_loglikelihood(engine, qa_prompt(first), options, method="mspoe")
    # bfloat16: a cached forward and a full forward round differently.
    assert [total for total, _ in fast] == pytest.approx(slow, abs=0.6)
