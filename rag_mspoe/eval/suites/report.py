"""Reports of a suite run, and the side-effect table that puts it beside a gold-position sweep.

Per task and method: the mean score (in %) on the examples every method has scored, and how
many prompts were cut in the middle. Per method: the long-context score (the mean of its
long-context task scores, as LongBench averages) and the short-context score (accuracy over all
knowledge questions), each with a paired test against the baseline on the same examples.

The side-effect table adds, from a sweep folder, each method's position-bias gain: its average
over gold positions minus the baseline's, and the same for the worst position.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rag_mspoe.eval.report import available_metrics, summarize
from rag_mspoe.eval.runs.manifest import read_manifest
from rag_mspoe.eval.runs.results import RESULTS_FILE, read_records
from rag_mspoe.eval.scoring.metrics import paired_test

SUMMARY_FILE = "summary.json"
TABLE_FILE = "table.md"
SIDE_EFFECTS_FILE = "side_effects.md"
BASELINE = "none"


def summarize_suite(records: Sequence[dict[str, Any]], method_order: Sequence[str] = ()) -> dict[str, Any]:
    """Scores per task and method on common examples; long- and short-context scores per method."""
    scores: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    truncated: dict[str, dict[str, int]] = defaultdict(dict)
    metric_of: dict[str, str] = {}
    for record in records:
        scores[(record["method"], record["task"])][str(record["example_id"])] = float(record["score"])
        metric_of[record["task"]] = record["metric"]
        if record.get("truncated_tokens"):
            truncated[record["task"]][str(record["example_id"])] = int(record["truncated_tokens"])
    methods = [
        m for m in dict.fromkeys([*method_order, *(m for m, _ in scores)]) if any(k[0] == m for k in scores)
    ]
    tasks = sorted({task for _, task in scores}, key=lambda task: (task.startswith("mmlu/"), task))
    common = {
        task: sorted(set.intersection(*(set(scores.get((m, task), {})) for m in methods))) for task in tasks
    }
    tasks = [task for task in tasks if common[task]]
    long_tasks = [task for task in tasks if not task.startswith("mmlu/")]
    short_tasks = [task for task in tasks if task.startswith("mmlu/")]
    summary: dict[str, Any] = {
        "baseline": BASELINE if BASELINE in methods else None,
        "tasks": {
            task: {
                "metric": metric_of[task],
                "examples": len(common[task]),
                "truncated": sum(1 for i in common[task] if i in truncated[task]),
            }
            for task in tasks
        },
        "methods": {},
    }
    for method in methods:
        per_task = {task: [scores[(method, task)][i] for i in common[task]] for task in tasks}
        entry: dict[str, Any] = {"tasks": {task: _mean(values) for task, values in per_task.items()}}
        entry["long_context"] = _mean([entry["tasks"][t] for t in long_tasks]) if long_tasks else None
        short_values = [v for t in short_tasks for v in per_task[t]]
        entry["short_context"] = _mean(short_values) if short_values else None
        if summary["baseline"] and method != BASELINE:
            base = {task: [scores[(BASELINE, task)][i] for i in common[task]] for task in tasks}
            if long_tasks:
                entry["p_long_vs_baseline"] = paired_test(
                    [v for t in long_tasks for v in per_task[t]], [v for t in long_tasks for v in base[t]]
                )
            if short_tasks:
                entry["p_short_vs_baseline"] = paired_test(
                    short_values, [v for t in short_tasks for v in base[t]]
                )
        summary["methods"][method] = entry
    return summary


def suite_table(summary: dict[str, Any]) -> str:
    """Tasks x methods (scores in %), then the long- and short-context scores per method."""
    methods = list(summary["methods"])
    header = ["task", "metric", "n", "cut", *methods]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for task, facts in summary["tasks"].items():
        cells = [task, facts["metric"], str(facts["examples"]), str(facts["truncated"])]
        cells += [_percent(summary["methods"][m]["tasks"].get(task)) for m in methods]
        lines.append("| " + " | ".join(cells) + " |")
    for label, key in (("long-context score", "long_context"), ("short-context score", "short_context")):
        if any(summary["methods"][m][key] is not None for m in methods):
            cells = [f"**{label}**", "", "", "", *(_percent(summary["methods"][m][key]) for m in methods)]
            lines.append("| " + " | ".join(cells) + " |")
    note = (
        "Scores in %, on the examples every method has scored; cut = prompts cut in the middle to fit "
        "the limit. Long-context score: mean of the long-context task scores; short-context score: "
        "accuracy over all knowledge questions."
    )
    return "\n".join(lines) + f"\n\n{note}\n"


def position_gains(sweep_folder: Path, metric: str | None = None) -> dict[str, dict[str, Any]]:
    """Per method of a sweep: average and worst-position gain over the baseline, in points.

    Read from the sweep's results.jsonl, or from its summary.json when only the report was kept."""
    records = read_records(sweep_folder / RESULTS_FILE)
    if records:
        chosen = metric or available_metrics(records)[0]
        summary = summarize(records, chosen, baseline=BASELINE)
    elif (sweep_folder / SUMMARY_FILE).is_file():
        report = json.loads((sweep_folder / SUMMARY_FILE).read_text())
        chosen = metric or report["main_metric"]
        summary = report["metrics"][chosen]
    else:
        raise ValueError(
            f"{sweep_folder} holds no sweep results ({RESULTS_FILE} or {SUMMARY_FILE}); "
            "run `rag-mspoe sweep` first."
        )
    if BASELINE not in summary["methods"]:
        raise ValueError(f"The sweep in {sweep_folder} has no '{BASELINE}' method to measure gains against.")
    base = summary["methods"][BASELINE]
    return {
        method: {
            "metric": chosen,
            "average_gain": 100 * (entry["average"] - base["average"]),
            "worst_gain": 100 * (entry["worst"] - base["worst"]),
            "p_average": entry.get("p_average_vs_baseline") or 1.0,
        }
        for method, entry in summary["methods"].items()
    }


def side_effect_table(suite: dict[str, Any], gains: dict[str, dict[str, Any]] | None) -> str:
    """One row per method: position-bias gain (from a sweep), long- and short-context scores."""
    gains = gains or {}
    methods = list(dict.fromkeys([*suite["methods"], *gains]))
    base = suite["methods"].get(BASELINE, {})
    header = ["method", "position-bias gain (avg / worst, pts)", "long-context score", "short-context score"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in methods:
        gain = gains.get(method)
        entry = suite["methods"].get(method)
        cells = [method, "-" if gain is None else f"{gain['average_gain']:+.1f} / {gain['worst_gain']:+.1f}"]
        for key, p_key in (("long_context", "p_long_vs_baseline"), ("short_context", "p_short_vs_baseline")):
            if entry is None or entry[key] is None:
                cells.append("n/a")
                continue
            cell = _percent(entry[key])
            if method != BASELINE and base.get(key) is not None:
                cell += f" ({100 * (entry[key] - base[key]):+.1f}, p={entry.get(p_key, 1.0):.2g})"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    metric = next(iter(gains.values()))["metric"] if gains else None
    note = "Scores in %; in brackets the change against the unmodified model and its paired-test p-value."
    if metric:
        note += (
            f" Position-bias gain: {metric} averaged over gold positions (and at the worst position), "
            "minus the unmodified model's."
        )
    note += (
        " n/a: the method does not apply (document reordering has no documents to reorder there) "
        "or was not run."
    )
    return "\n".join(lines) + f"\n\n{note}\n"


def write_suite_report(
    folder: Path, method_order: Sequence[str] = (), sweep: Path | None = None
) -> dict[str, Any]:
    """summary.json and table.md (and side_effects.md, with a sweep folder) from results.jsonl."""
    records = read_records(folder / RESULTS_FILE)
    if not records:
        raise ValueError(f"{folder} has no results yet; run `rag-mspoe suite` into it first.")
    order = method_order or ((read_manifest(folder) or {}).get("suite") or {}).get("methods", [])
    summary = summarize_suite(records, order)
    gains = position_gains(sweep) if sweep is not None else None
    summary["markdown"] = suite_table(summary)
    summary["side_effects"] = side_effect_table(summary, gains)
    if gains is not None:
        summary["position_gains"] = gains
        summary["sweep"] = str(sweep)
    (folder / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    (folder / TABLE_FILE).write_text(summary["markdown"])
    (folder / SIDE_EFFECTS_FILE).write_text(summary["side_effects"])
    return summary


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"
