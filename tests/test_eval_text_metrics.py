"""The LongBench / ZeroSCROLLS metrics against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from rag_mspoe.eval.scoring.text_metrics import (
    classification_score,
    count_score,
    edit_similarity,
    exact_match,
    retrieval_score,
    rouge,
    rouge_geometric_mean,
    rouge_l,
    score_text,
    token_f1,
)


def test_token_f1_counts_shared_normalised_tokens():
    # "the" and the full stop go; prediction [eiffel, tower, in, paris], reference [paris, france]:
    # one shared token, precision 1/4, recall 1/2, F1 = 2 * 1/8 / (3/4) = 1/3.
    assert token_f1("The Eiffel tower in Paris.", "Paris France") == pytest.approx(1 / 3)
    assert token_f1("Paris", "paris") == 1.0
    assert token_f1("London", "Paris") == 0.0
    # Repeated tokens count as often as both sides have them: [a, b, b] vs [b, b, c] share 2.
    assert token_f1("x y y", "y y z") == pytest.approx(2 / 3)


def test_exact_match_reads_the_first_line_normalised():
    assert exact_match("  The Paris.\nbecause ...", "paris") == 1.0
    assert exact_match("Paris, France", "Paris") == 0.0


def test_rouge_l_is_the_longest_common_subsequence_f_measure():
    # LCS of "the cat sat on the mat" and "the cat lay on the mat" is 5 of 6 tokens each way.
    assert rouge_l("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(5 / 6)
    assert rouge_l("completely different words", "the cat lay on the mat") == 0.0


def test_rouge_geometric_mean_of_rouge_1_2_l():
    prediction, reference = "alpha beta gamma delta", "alpha beta omega delta"
    # ROUGE-1: 3 of 4 unigrams; ROUGE-2: 1 of 3 bigrams (alpha beta); ROUGE-L: LCS alpha beta delta.
    scores = rouge(prediction, reference, stemmer=True)
    assert scores == pytest.approx({"rouge1": 0.75, "rouge2": 1 / 3, "rougeL": 0.75})
    assert rouge_geometric_mean(prediction, reference) == pytest.approx((0.75 * (1 / 3) * 0.75) ** (1 / 3))
    # Stemming makes "cats" and "cat" one token, so these match fully.
    assert rouge_geometric_mean("cats running", "cat running") == pytest.approx(1.0)


def test_edit_similarity_scores_the_first_code_line():
    # The comment line is skipped; "x = 1" against "x = 2": one substitution is two indel edits
    # over 10 characters, similarity 8/10.
    assert edit_similarity("# set x\nx = 1\ny = 2", "x = 2") == pytest.approx(0.8)
    assert edit_similarity("```python\nreturn a + b", "return a + b") == 1.0
    assert edit_similarity("// only comments", "x") == 0.0


def test_count_and_retrieval_scores_are_the_share_of_right_numbers():
    assert count_score("There are 3, maybe 4; I say 3", "3") == pytest.approx(2 / 3)
    assert count_score("no number here", "3") == 0.0
    assert retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert retrieval_score("It is 12 or 3", "Paragraph 3") == 0.5
    with pytest.raises(ValueError, match="Paragraph N"):
        retrieval_score("3", "three")


def test_classification_score_splits_credit_among_the_classes_named():
    classes = ["city", "country", "state"]
    assert classification_score("city or state", "city", classes) == 0.5
    assert classification_score("a country", "city", classes) == 0.0
    # A class inside the reference (but not it) is not held against the answer.
    assert classification_score("Other location", "Other location", ["location", "Other location"]) == 1.0
    with pytest.raises(ValueError, match="all_classes"):
        classification_score("city", "city", [])


def test_score_text_takes_the_best_reference_and_checks_its_input():
    assert score_text("qa_f1", "Paris", ["London", "Paris"]) == 1.0
    assert score_text("substring_match", "It is Paris, I think.", ["paris"]) == 1.0
    assert score_text("substring_match", "Well.\nParis", ["paris"]) == 0.0
    assert score_text("contains", "Well.\nIt is 4130", ["4130"]) == 1.0
    assert score_text("classification", "city", ["city"], ["city", "town"]) == 1.0
    with pytest.raises(ValueError, match="Unknown metric 'bleu'"):
        score_text("bleu", "x", ["x"])
    with pytest.raises(ValueError, match="No reference"):
        score_text("qa_f1", "x", [])
    assert math.isclose(score_text("rouge_l", "a b", ["a b"]), 1.0)
