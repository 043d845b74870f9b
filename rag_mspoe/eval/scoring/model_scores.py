"""Score examples with the engine: greedy answers, gold-answer log-likelihood, forced choice.

Prompts go in as built by `rag_mspoe.eval.data.prompts` (one user message each, through the chat
template); an answer is scored as the start of the assistant's reply, since every prompt ends
with its answer cue. `method` is any method spec the engine takes (None: the engine's default).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rag_mspoe.engine import MethodSpec
from rag_mspoe.engine.protocol import AnswersPrompts, EngineLike, ScoresWhileGenerating
from rag_mspoe.eval.data.records import KVExample, QAExample
from rag_mspoe.eval.scoring.metrics import best_subspan_em, kv_match
from rag_mspoe.prompts.chat_template import Prompt


def score_generation(
    engine: AnswersPrompts,
    prompts: Sequence[Prompt],
    examples: Sequence[QAExample | KVExample],
    *,
    method: MethodSpec,
    max_new_tokens: int = 100,
    batch_size: int = 8,
    gold: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Greedy answers, `batch_size` prompts per `generate_batch` call, each scored by its metric:
    `best_subspan_em` for QA, `kv_match` for KV. Returns {"prediction", "correct"} per example.

    A QA answer counts only up to its first newline, so QA-only batches stop generating there
    (same score, far less decoding) and their predictions hold that first line.

    gold: one answer per example whose log-likelihood to score too ("gold_logprob", "gold_tokens"
    as `score_loglikelihood` gives them), from the prefill that generation makes
    (`Engine.generate_and_score`); only for engines that have it.
    """
    if len(prompts) != len(examples):
        raise ValueError(f"{len(prompts)} prompts for {len(examples)} examples; give one prompt per example.")
    if gold is not None and len(gold) != len(examples):
        raise ValueError(f"{len(gold)} gold answers for {len(examples)} examples; give one per example.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
    results = []
    for first in range(0, len(prompts), batch_size):
        batch = examples[first : first + batch_size]
        texts = list(prompts[first : first + batch_size])
        settings: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "stop": ["\n"] if all(isinstance(example, QAExample) for example in batch) else [],
            "method": method,
        }
        if gold is None:
            answers = engine.generate_batch(texts, **settings)
            scores: list[Any] = [None] * len(answers)
        else:
            answers_to_score = [[checked_answer(text)] for text in gold[first : first + batch_size]]
            if not isinstance(engine, ScoresWhileGenerating):  # a remote engine's answers come unscored
                raise TypeError(
                    f"{type(engine).__name__} does not score answers while generating; pass gold=None."
                )
            pairs = engine.generate_and_score(list(zip(texts, answers_to_score, strict=True)), **settings)
            answers, scores = [answer for answer, _ in pairs], [scored for _, scored in pairs]
        for example, answer, scored in zip(batch, answers, scores, strict=True):
            if isinstance(example, QAExample):
                correct = best_subspan_em(answer.text, example.answers)
            else:
                correct = kv_match(answer.text, example.value)
            result: dict[str, Any] = {"prediction": answer.text, "correct": correct}
            if scored is not None:
                ((total, tokens),) = scored
                result.update(gold_logprob=total, gold_tokens=tokens)
            results.append(result)
    return results


def score_loglikelihood(
    engine: EngineLike, prompt: Prompt, answer: str, *, method: MethodSpec, prefix: str = ""
) -> dict[str, float]:
    """Teacher-forced log-likelihood of `answer` as the reply to `prompt`:
    {"sum": total log-probability, "mean": per token, "tokens": token count}."""
    ((total, tokens),) = engine.score_continuations(
        prompt, [checked_answer(answer)], prefix=prefix, method=method
    )
    return {"sum": total, "mean": total / tokens, "tokens": tokens}


def checked_answer(answer: str) -> str:
    """The answer to score, refused when empty (it would score zero tokens)."""
    if not answer:
        raise ValueError("The answer to score is empty; pass the gold answer text.")
    return answer


def score_forced_choice(
    engine: EngineLike,
    prompt: Prompt,
    candidates: Sequence[str],
    gold: str,
    *,
    method: MethodSpec,
    prefix: str = "",
) -> dict[str, Any]:
    """Pick the candidate with the highest mean log-probability per token (length-normalised by
    token count, so long candidates are not penalised for their length).

    Returns {"choice", "correct" (1.0 or 0.0), "scores" {candidate: mean log-probability},
    "gold_share" (the gold's share of the softmax over those scores: a smooth accuracy that tiny
    samples need), "gold_sum" (the gold's total log-probability), "gold_tokens"}. Ties go to the
    earlier candidate. All candidates are scored from one prefill of the prompt.
    """
    options = checked_candidates(candidates, gold)
    scored = engine.score_continuations(prompt, options, prefix=prefix, method=method)
    return forced_choice(options, gold, scored)


def checked_candidates(candidates: Sequence[str], gold: str) -> list[str]:
    """The candidates as a list, refused unless distinct, non-empty and holding the gold answer."""
    options = list(candidates)
    if len(set(options)) != len(options) or not all(options):
        raise ValueError(f"Candidates must be distinct non-empty strings, got {options!r}.")
    if gold not in options:
        raise ValueError(f"The gold answer {gold!r} is not among the candidates {options!r}; add it.")
    return options


def forced_choice(options: Sequence[str], gold: str, scored: Sequence[tuple[float, int]]) -> dict[str, Any]:
    """`score_forced_choice`'s result from each option's (sum of log-probabilities, tokens)."""
    scores = {option: total / tokens for option, (total, tokens) in zip(options, scored, strict=True)}
    choice = max(options, key=lambda option: scores[option])
    gold_sum, gold_tokens = scored[list(options).index(gold)]
    top = max(scores.values())
    gold_share = math.exp(scores[gold] - top) / sum(math.exp(score - top) for score in scores.values())
    return {
        "choice": choice,
        "correct": 1.0 if choice == gold else 0.0,
        "scores": scores,
        "gold_share": gold_share,
        "gold_sum": gold_sum,
        "gold_tokens": gold_tokens,
    }
