"""Metrics against hand-computed values: the paper's normalisation and matching, position summaries,
bootstrap intervals and paired tests."""

from __future__ import annotations

import itertools

import pytest

from rag_mspoe.eval.scoring.metrics import (
    best_subspan_em,
    bootstrap_ci,
    kv_match,
    normalize_answer,
    paired_test,
    position_summary,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The  Quick, brown FOX!", "quick brown fox"),
        ("An apple a day", "apple day"),
        ("U.S.A.", "usa"),
        ("theatre anatomy", "theatre anatomy"),  # articles only as whole words
        ("the-the", "thethe"),  # punctuation goes first, so this is no longer an article
        ("Café—Bar «x»", "café—bar «x»"),  # only ASCII punctuation is dropped
        ("\tNew\nYork  City ", "new york city"),
        ("A", ""),
    ],
)
def test_squad_normalisation(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    ("prediction", "answers", "expected"),
    [
        ("It was the Beatles, I think.", ["The Beatles"], 1.0),
        ("Beatle", ["The Beatles"], 0.0),
        ("paris", ["London", "Paris"], 1.0),
        ("Paris is nice.\nLondon", ["London"], 0.0),  # only the first line counts
        ("Paris is nice.\nLondon", ["paris"], 1.0),
        ("\nParis", ["Paris"], 0.0),
        ("In 1743, settlers came", ["1743"], 1.0),
        ("100 years", ["10"], 1.0),  # a substring is enough, as published
        ("Saint-Étienne", ["saint étienne"], 0.0),  # the hyphen is removed, not turned into a space
        ("Saint-Étienne", ["SaintÉtienne"], 1.0),
    ],
)
def test_best_subspan_em(prediction, answers, expected):
    assert best_subspan_em(prediction, answers) == expected


def test_kv_match_ignores_case_and_searches_the_whole_answer():
    value = "0b7e-ABCD"
    assert kv_match("The value is 0B7E-abcd.", value) == 1.0
    assert kv_match("first line\nthen 0b7e-abcd", value) == 1.0
    assert kv_match("0b7e abcd", value) == 0.0


def test_position_summary():
    summary = position_summary({9: [1, 0, 1, 0], 0: [1, 1, 0, 1], 4: [0, 0, 1, 0]})
    assert summary["accuracy"] == {0: 0.75, 4: 0.25, 9: 0.5}
    assert list(summary["accuracy"]) == [0, 4, 9]
    assert summary["count"] == {0: 4, 4: 4, 9: 4}
    assert summary["average"] == pytest.approx(0.5)
    assert (summary["worst_position"], summary["worst"]) == (4, 0.25)
    assert (summary["best_position"], summary["best"]) == (0, 0.75)
    assert summary["gap"] == pytest.approx(0.5)


def test_position_summary_weighs_positions_equally_and_breaks_ties_early():
    summary = position_summary({0: [1.0], 1: [0.0, 0.0, 0.0], 2: [1.0, 1.0]})
    assert summary["average"] == pytest.approx(2 / 3)  # not 3/6 over all scores
    assert summary["best_position"] == 0 and summary["worst_position"] == 1


def test_position_summary_rejects_missing_scores():
    with pytest.raises(ValueError, match="No positions"):
        position_summary({})
    with pytest.raises(ValueError, match=r"Position\(s\) \[3\]"):
        position_summary({0: [1.0], 3: []})


def test_bootstrap_interval_width_matches_the_normal_approximation():
    values = [1.0, 0.0] * 200  # mean 0.5, standard error sqrt(0.25 / 400) = 0.025
    low, high = bootstrap_ci(values, confidence=0.95, resamples=4000, seed=1)
    assert low < 0.5 < high
    assert high - low == pytest.approx(2 * 1.96 * 0.025, rel=0.12)
    assert bootstrap_ci(values, resamples=500, seed=3) == bootstrap_ci(values, resamples=500, seed=3)


def test_bootstrap_of_constant_values_and_bad_input():
    assert bootstrap_ci([0.7] * 5) == pytest.approx((0.7, 0.7))
    narrow = bootstrap_ci([1.0, 0.0] * 50, confidence=0.5)
    wide = bootstrap_ci([1.0, 0.0] * 50, confidence=0.99)
    assert wide[0] < narrow[0] < narrow[1] < wide[1]
    with pytest.raises(ValueError, match="at least one value"):
        bootstrap_ci([])
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_ci([1.0], confidence=1.0)


@pytest.mark.parametrize(
    ("only_a", "only_b", "expected"),
    [
        (5, 0, 2 / 32),  # two-sided binomial tail: 2 * (1/2)^5
        (8, 1, 2 * (1 + 9) / 2**9),  # tail: C(9, 0) + C(9, 1) of 2^9
        (2, 1, 1.0),  # 2 * (1 + 3) / 8 is capped at 1
        (0, 0, 1.0),
    ],
)
def test_mcnemar_exact_on_zero_one_scores(only_a, only_b, expected):
    both = 3
    a = [1.0] * only_a + [0.0] * only_b + [1.0] * both + [0.0] * 2
    b = [0.0] * only_a + [1.0] * only_b + [1.0] * both + [0.0] * 2
    assert paired_test(a, b) == pytest.approx(expected)
    assert paired_test(b, a) == pytest.approx(expected)


def test_sign_flip_test_on_real_valued_scores():
    # Three differences of +0.5: only the all-plus and all-minus sign patterns reach |mean| 0.5.
    assert paired_test([1.5, 2.5, 3.5], [1.0, 2.0, 3.0]) == pytest.approx(2 / 8)
    # Differences +1 and -1 average to 0: every pattern is at least as extreme.
    assert paired_test([2.0, 0.5], [1.0, 1.5]) == 1.0
    # Above 16 pairs the flips are sampled: 30 equal differences are matched only by all-equal signs
    # (chance 2^-29), so no sample reaches them and p is the floor 1 / (resamples + 1).
    shifted = [x + 0.25 for x in range(30)]
    assert paired_test(shifted, list(range(30)), seed=0, resamples=999) == pytest.approx(1 / 1000)
    # Mixed differences: the sampled p-value is close to the exact one and fixed by the seed.
    noisy = [0.3, -0.1, 0.2, 0.25, -0.05] * 3 + [0.1, -0.4]  # 17 pairs
    p = paired_test(noisy, [0.0] * 17, seed=0, resamples=20000)
    assert p == paired_test(noisy, [0.0] * 17, seed=0, resamples=20000)
    assert p == pytest.approx(_exact_sign_flip(noisy), abs=0.01)


def test_paired_test_needs_pairs():
    with pytest.raises(ValueError, match="equal lengths"):
        paired_test([1.0, 0.0], [1.0])
    with pytest.raises(ValueError, match="at least one pair"):
        paired_test([], [])


def _exact_sign_flip(differences):
    observed = abs(sum(differences))
    patterns = list(itertools.product((-1, 1), repeat=len(differences)))
    extreme = sum(
        abs(sum(s * d for s, d in zip(signs, differences, strict=True))) >= observed - 1e-12
        for signs in patterns
    )
    return extreme / len(patterns)
