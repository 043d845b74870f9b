"""The demo's position curve from the committed validation of the shipped method: no model runs.

Eight live questions cannot show a 12-point gain; the 300-question validation that made the
method ship can. Its per-question scores travel with the package (`rag_mspoe.calibrated.validation`),
and are summarised here by `rag_mspoe.eval.report.summarize`, the statistics of `rag-mspoe report`:
mean per gold position with a 95% bootstrap interval, and a paired test against the unmodified
model on the same questions (McNemar for exact match, sign-flip for the log-likelihood).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rag_mspoe.calibrated.validation import (
    BASELINE,
    SHIPPED,
    middle_position,
    validation_metrics,
    validation_records,
)

# What the demo writes beside its answers: one plot per metric.
PLOTS = {"match": "committed-curve-exact-match.png", "gold_logprob": "committed-curve-loglik.png"}
_LABELS = {"match": "exact match (%)", "gold_logprob": "gold answer log-likelihood (nats)"}


def summarize_validation(validation: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per metric the validation holds, `summarize`'s summary of the unmodified model and the
    shipped method."""
    from rag_mspoe.eval.report import summarize

    records = validation_records(validation)
    return {
        metric: summarize(records, metric, baseline=BASELINE, method_order=(BASELINE, SHIPPED))
        for metric in validation_metrics(validation)
    }


def _where(position: int, count: int) -> str:
    name = "first" if position == 0 else "last" if position == count - 1 else "middle"
    return f"{name} ({position + 1} of {count})"


def _table(summary: dict[str, Any], count: int) -> list[str]:
    percent = summary["metric"] == "match"
    scale, digits, unit = (100.0, 1, " points") if percent else (1.0, 2, " nats")
    base, shipped = summary["methods"][BASELINE], summary["methods"][SHIPPED]
    # The first column fits its longest row name ("middle (10 of 20)") and a space.
    first = max(17, *(len(_where(position, count)) + 1 for position in summary["positions"]))

    def cell(entry: dict[str, Any], position: int) -> str:
        low, high = entry["ci"][position]
        return (
            f"{scale * entry['accuracy'][position]:.{digits}f} "
            f"[{scale * low:.{digits}f}, {scale * high:.{digits}f}]"
        )

    lines = [
        f"  {_LABELS[summary['metric']]}, [95% bootstrap interval]",
        f"  {'gold document':<{first}}{'none':<22}{'calibrated':<22}{'difference':<14}p (paired)",
    ]
    for position in summary["positions"]:
        gain = scale * (shipped["accuracy"][position] - base["accuracy"][position])
        lines.append(
            f"  {_where(position, count):<{first}}{cell(base, position):<22}{cell(shipped, position):<22}"
            f"{gain:+.{digits}f}{unit:<{14 - len(f'{gain:+.{digits}f}')}}"
            f"{shipped['p_vs_baseline'][position]:.2g}"
        )
    gain = scale * (shipped["average"] - base["average"])
    lines.append(
        f"  {'average':<{first}}"
        f"{scale * base['average']:<22.{digits}f}{scale * shipped['average']:<22.{digits}f}"
        f"{gain:+.{digits}f}{unit:<{14 - len(f'{gain:+.{digits}f}')}}"
        f"{shipped['p_average_vs_baseline']:.2g}"
    )
    return lines


def committed_curve(validation: dict[str, Any], out: Path) -> str:
    """The committed curve as text (tables, n, the headline gain, the command that reproduces
    it), with one plot per metric written into `out`."""
    from rag_mspoe.eval.report import plot

    summaries = summarize_validation(validation)
    count = validation["num_documents"]
    questions = len(validation["questions"])
    middle = middle_position(validation)
    match = summaries["match"]["methods"]
    loglik_test = ", sign-flip for the log-likelihood" if "gold_logprob" in summaries else ""
    tests = f"McNemar for exact match{loglik_test}"
    lines = [
        f"The committed run, not this machine: {validation['model']}, {questions} real NQ-open questions "
        f"per position, none of them used to choose the method, {count} documents, the gold document "
        f"first, in the middle and last (records: {validation['run']} in the repository).",
        f"n = {questions} questions at every position, the same for both, so every test is paired ({tests}).",
        "",
        *(line for metric in summaries for line in (*_table(summaries[metric], count), "")),
        f"With the gold document in the middle, the shipped method answers "
        f"{100 * match[SHIPPED]['accuracy'][middle]:.1f} % against the unmodified model's "
        f"{100 * match[BASELINE]['accuracy'][middle]:.1f} % "
        f"({100 * (match[SHIPPED]['accuracy'][middle] - match[BASELINE]['accuracy'][middle]):+.1f} points, "
        f"p = {match[SHIPPED]['p_vs_baseline'][middle]:.2g}).",
    ]
    title = f"Committed run: {validation['model']}, {count} documents, {questions} questions per position"
    plots = [out / PLOTS[metric] for metric in summaries]
    for metric, path in zip(summaries, plots, strict=True):
        plot(summaries[metric], path, title=title)
    lines.append(f"Plots: {', '.join(str(path) for path in plots)}")
    lines.append(
        f"Reproduce it in a clone of the repository ({validation['cpu_hours']} CPU hours in the records):"
    )
    lines.append(f"  {validation['command']}")
    return "\n".join(lines)


def other_counts(validations: list[dict[str, Any]]) -> list[str]:
    """One line per validation after the headline one (the other document counts the shipped
    method was measured at): the middle position and the worst, with their paired tests."""
    lines = []
    for validation in validations[1:]:
        match = summarize_validation(validation)["match"]["methods"]
        base, shipped = match[BASELINE], match[SHIPPED]
        middle = middle_position(validation)
        lines.append(
            f"At {validation['num_documents']} documents ({len(validation['questions'])} held-out questions "
            f"per position): gold in the middle {100 * base['accuracy'][middle]:.1f} % -> "
            f"{100 * shipped['accuracy'][middle]:.1f} % (p = {shipped['p_vs_baseline'][middle]:.2g}), "
            f"worst position {100 * base['worst']:.1f} % -> {100 * shipped['worst']:.1f} % "
            f"(p = {shipped['p_worst_vs_baseline']:.2g})."
        )
    return lines
