"""Scores of generated text against reference answers: the LongBench and ZeroSCROLLS metrics.

Every metric takes (prediction, references, classes) and returns a score in [0, 1], the best
over the references (a question may have several acceptable answers). `classes` is only read by
`classification`. ROUGE comes from Google's `rouge-score` and edit similarity from `rapidfuzz`;
the published LongBench scripts use the `rouge` and `fuzzywuzzy` packages, whose numbers can
differ from these in the second decimal of a percentage.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from rag_mspoe.eval.scoring.metrics import best_subspan_em, kv_match, normalize_answer

Metric = Callable[[str, Sequence[str], Sequence[str]], float]
_NUMBER = re.compile(r"\d+")


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD token F1 of the normalised texts (lowercase, no punctuation or articles)."""
    predicted = normalize_answer(prediction).split()
    gold = normalize_answer(reference).split()
    common = sum((Counter(predicted) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the normalised first line of the prediction equals the normalised reference."""
    first_line = prediction.strip().split("\n")[0]
    return float(normalize_answer(first_line) == normalize_answer(reference))


@functools.cache
def _rouge_scorer(stemmer: bool) -> Any:
    try:
        from rouge_score import rouge_scorer
    except ImportError:
        raise ImportError('ROUGE needs the rouge-score package: pip install "rag-mspoe[eval]".') from None
    return rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=stemmer)


def rouge(prediction: str, reference: str, *, stemmer: bool = False) -> dict[str, float]:
    """F-measures of ROUGE-1, ROUGE-2 and ROUGE-L (longest common subsequence)."""
    scores = _rouge_scorer(stemmer).score(reference, prediction)
    return {name: float(score.fmeasure) for name, score in scores.items()}


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure, LongBench's summarisation metric (no stemming, as its `rouge` package)."""
    return rouge(prediction, reference)["rougeL"]


def rouge_geometric_mean(prediction: str, reference: str) -> float:
    """Geometric mean of ROUGE-1/2/L F-measures with stemming: ZeroSCROLLS's summarisation metric."""
    scores = rouge(prediction, reference, stemmer=True)
    return math.prod(scores.values()) ** (1 / 3)


def edit_similarity(prediction: str, reference: str) -> float:
    """LongBench's code metric: the first generated line that is not a comment or a code fence,
    against the reference line, by normalised Levenshtein similarity (fuzz.ratio / 100)."""
    from rapidfuzz import fuzz

    line = next(
        (
            candidate
            for candidate in prediction.lstrip("\n").split("\n")
            if not any(mark in candidate for mark in ("`", "#", "//"))
        ),
        "",
    )
    return float(fuzz.ratio(line, reference)) / 100


def count_score(prediction: str, reference: str) -> float:
    """Share of the numbers in the prediction that equal the reference count (LongBench passage_count)."""
    numbers = _NUMBER.findall(prediction)
    return sum(number == reference.strip() for number in numbers) / len(numbers) if numbers else 0.0


def retrieval_score(prediction: str, reference: str) -> float:
    """Share of the numbers in the prediction that equal the reference paragraph number
    ("Paragraph 7" -> 7; LongBench passage_retrieval)."""
    match = re.search(r"Paragraph (\d+)", reference)
    if match is None:
        raise ValueError(f"Reference {reference!r} names no 'Paragraph N'; this is not passage retrieval.")
    return count_score(prediction, match.group(1))


def classification_score(prediction: str, reference: str, classes: Sequence[str]) -> float:
    """LongBench's classification metric (trec): the class names found in the prediction, less
    those that are part of the reference without being it; 1/len(found) if the reference is among
    them, else 0. (The published script also has a fuzzy fallback for when nothing is found, but
    a bug means it never runs; we score as the published numbers were scored.)"""
    if not classes:
        raise ValueError("Classification needs the task's class names ('all_classes' in LongBench records).")
    found = [name for name in classes if name in prediction]
    found = [name for name in found if not (name in reference and name != reference)]
    return 1.0 / len(found) if reference in found else 0.0


def _best(score: Callable[[str, str], float]) -> Metric:
    def metric(prediction: str, references: Sequence[str], classes: Sequence[str] = ()) -> float:
        return max(score(prediction, reference) for reference in references)

    return metric


def _classification(prediction: str, references: Sequence[str], classes: Sequence[str] = ()) -> float:
    return max(classification_score(prediction, reference, classes) for reference in references)


def _substring(prediction: str, references: Sequence[str], classes: Sequence[str] = ()) -> float:
    """The lost-in-the-middle metric: a normalised reference inside the answer's first line."""
    return best_subspan_em(prediction, references)


def _contains(prediction: str, references: Sequence[str], classes: Sequence[str] = ()) -> float:
    """The lost-in-the-middle KV metric: a reference anywhere in the answer, ignoring case."""
    return max(kv_match(prediction, reference) for reference in references)


TEXT_METRICS: dict[str, Metric] = {
    "qa_f1": _best(token_f1),
    "rouge_l": _best(rouge_l),
    "rouge_geometric_mean": _best(rouge_geometric_mean),
    "exact_match": _best(exact_match),
    "substring_match": _substring,
    "contains": _contains,
    "classification": _classification,
    "count": _best(count_score),
    "retrieval": _best(retrieval_score),
    "edit_similarity": _best(edit_similarity),
}


def score_text(metric: str, prediction: str, references: Sequence[str], classes: Sequence[str] = ()) -> float:
    """Score one prediction with the named metric (a key of TEXT_METRICS)."""
    if metric not in TEXT_METRICS:
        raise ValueError(f"Unknown metric {metric!r}; choose from {', '.join(TEXT_METRICS)}.")
    if not references:
        raise ValueError("No reference answers to score against; give at least one.")
    return TEXT_METRICS[metric](prediction, references, classes)
