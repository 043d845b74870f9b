"""The rule a method config ships by, applied to its committed validation at one document count.

The validation records travel with the package (`rag_mspoe.calibrated.validation`); the rule
reads them with the statistics of `rag-mspoe report`.
"""

from __future__ import annotations

from typing import Any

from rag_mspoe.calibrated.validation import BASELINE, SHIPPED, validation_records
from rag_mspoe.eval.report import summarize


def wins(validation: dict[str, Any], significance: float = 0.05) -> bool:
    """Whether the shipped method won in this validation, by exact match: its worst position above
    the unmodified model's worst (paired p < `significance`), its average not lower, and no
    position significantly lower. The rule a config ships by, applied to each document count."""
    summary = summarize(
        validation_records(validation), "match", baseline=BASELINE, method_order=(BASELINE, SHIPPED)
    )
    base, shipped = summary["methods"][BASELINE], summary["methods"][SHIPPED]
    significantly_lower = any(
        shipped["accuracy"][p] < base["accuracy"][p] and shipped["p_vs_baseline"][p] < significance
        for p in summary["positions"]
    )
    return (
        shipped["worst"] > base["worst"]
        and shipped["p_worst_vs_baseline"] < significance
        and shipped["average"] >= base["average"]
        and not significantly_lower
    )
