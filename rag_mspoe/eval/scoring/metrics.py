"""Scores of single answers, summaries per gold position, and the statistics to compare methods.

`best_subspan_em` and `kv_match` are the lost-in-the-middle metrics, exactly as published.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop ASCII punctuation, drop a/an/the, squeeze whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def best_subspan_em(prediction: str, answers: Iterable[str]) -> float:
    """1.0 if any normalised gold answer is a substring of the normalised prediction, else 0.0.

    Only the prediction's first line counts, so copying the context back cannot score.
    """
    predicted = normalize_answer(prediction.split("\n")[0])
    return 1.0 if any(normalize_answer(answer) in predicted for answer in answers) else 0.0


def kv_match(prediction: str, value: str) -> float:
    """1.0 if the value occurs anywhere in the prediction, ignoring case, else 0.0."""
    return 1.0 if value.lower() in prediction.lower() else 0.0


def position_summary(per_position: dict[int, list[float]]) -> dict[str, Any]:
    """Accuracy per gold position, their average, the worst and best positions, and the gap.

    The average weighs positions equally (the mean of the per-position accuracies). Ties for
    worst or best go to the earliest position.
    """
    if not per_position:
        raise ValueError("No positions to summarise; pass {gold position: [scores]}.")
    empty = sorted(position for position, scores in per_position.items() if not scores)
    if empty:
        raise ValueError(f"Position(s) {empty} have no scores; drop them or run their examples first.")
    positions = sorted(per_position)
    accuracy = {position: float(np.mean(per_position[position])) for position in positions}
    worst = min(positions, key=lambda position: accuracy[position])
    best = max(positions, key=lambda position: accuracy[position])
    return {
        "accuracy": accuracy,
        "count": {position: len(per_position[position]) for position in positions},
        "average": float(np.mean(list(accuracy.values()))),
        "worst_position": worst,
        "worst": accuracy[worst],
        "best_position": best,
        "best": accuracy[best],
        "gap": accuracy[best] - accuracy[worst],
    }


def bootstrap_ci(
    values: Sequence[float], confidence: float = 0.95, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval for the mean of `values`."""
    if len(values) == 0:
        raise ValueError("bootstrap_ci needs at least one value.")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}.")
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}.")
    data = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, len(data), size=(resamples, len(data)))].mean(axis=1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(low), float(high)


def paired_test(a: Sequence[float], b: Sequence[float], seed: int = 0, resamples: int = 10000) -> float:
    """Two-sided p-value that a and b, scored on the same examples in the same order, differ.

    0/1 scores (accuracy): exact McNemar test, a binomial test on the discordant pairs.
    Other scores (log-likelihoods): paired sign-flip permutation test on the mean difference,
    exact when there are at most 16 pairs, else `resamples` random flips (seeded).
    """
    if len(a) != len(b):
        raise ValueError(
            f"Paired scores need equal lengths, got {len(a)} and {len(b)}; score the same examples."
        )
    if len(a) == 0:
        raise ValueError("paired_test needs at least one pair.")
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if np.isin(x, (0.0, 1.0)).all() and np.isin(y, (0.0, 1.0)).all():
        return _mcnemar_exact(int(((x == 1) & (y == 0)).sum()), int(((x == 0) & (y == 1)).sum()))
    return _sign_flip(x - y, seed, resamples)


def _mcnemar_exact(only_a: int, only_b: int) -> float:
    discordant = only_a + only_b
    if discordant == 0:
        return 1.0
    tail = sum(math.comb(discordant, k) for k in range(min(only_a, only_b) + 1)) / 2**discordant
    return min(1.0, 2 * tail)


def _sign_flip(differences: np.ndarray, seed: int, resamples: int) -> float:
    observed = abs(differences.mean())
    n = len(differences)
    if n <= 16:  # every one of the 2^n sign patterns
        patterns = ((np.arange(2**n)[:, None] >> np.arange(n)) & 1) * 2 - 1
        flipped = np.abs((patterns * differences).mean(axis=1))
        return float((flipped >= observed - 1e-12).mean())
    signs = np.random.default_rng(seed).choice((-1.0, 1.0), size=(resamples, n))
    flipped = np.abs((signs * differences).mean(axis=1))
    # Counting the observed labelling keeps the p-value valid (never 0).
    return float(((flipped >= observed - 1e-12).sum() + 1) / (resamples + 1))
