"""Reports of a sweep folder: summary.json, table.md, accuracy_by_position.png; and a comparison
of two run folders of any one kind.

Accuracy is read by the gold document's position in the retrieval order the sweep set (the
`position` of a record). Only examples scored for every method at a position count there, so
every method is measured on the same examples and the paired test against the baseline holds.
The report reads whatever results.jsonl holds, so it also summarises a run still in progress.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rag_mspoe.eval.runs.loop import Evaluation, folder_kind
from rag_mspoe.eval.runs.manifest import MANIFEST_FILE, read_manifest
from rag_mspoe.eval.runs.results import read_run_records
from rag_mspoe.eval.scoring.metrics import bootstrap_ci, paired_test, position_summary
from rag_mspoe.files import check_output_folder
from rag_mspoe.models.embedded_models import DEFAULT_MODEL

SUMMARY_FILE = "summary.json"
TABLE_FILE = "table.md"
PLOT_FILE = "accuracy_by_position.png"
COMPARISON_FILE = "comparison.json"
METRICS = ("choice_correct", "match", "gold_logprob")
METRIC_LABELS = {
    "choice_correct": "forced-choice accuracy",
    "match": "exact match (best subspan)",
    "gold_logprob": "gold answer log-likelihood",
}


def available_metrics(records: Sequence[dict[str, Any]]) -> list[str]:
    return [m for m in METRICS if any(m in r for r in records)]


def summarize(
    records: Sequence[dict[str, Any]],
    metric: str,
    *,
    baseline: str = "none",
    method_order: Sequence[str] = (),
) -> dict[str, Any]:
    """Per method: per-position mean, CI, paired p-value against `baseline`; average, worst, gap."""
    scores: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    for record in records:
        if metric in record:
            scores[(record["method"], int(record["position"]))][str(record["example_id"])] = float(
                record[metric]
            )
    methods = list(dict.fromkeys([*method_order, *(m for m, _ in scores)]))
    methods = [m for m in methods if any(key[0] == m for key in scores)]
    positions = sorted({p for _, p in scores})
    # Examples every method has at a position: the common, paired sample.
    common = {
        p: sorted(set.intersection(*(set(scores.get((m, p), {})) for m in methods)), key=_natural)
        for p in positions
    }
    positions = [p for p in positions if common[p]]
    everywhere = (
        sorted(set.intersection(*(set(common[p]) for p in positions)), key=_natural) if positions else []
    )
    summary: dict[str, Any] = {
        "metric": metric,
        "baseline": baseline if baseline in methods else None,
        "positions": positions,
        "examples_per_position": {p: len(common[p]) for p in positions},
        "methods": {},
    }
    if not positions:
        return summary
    base_worst = None
    if summary["baseline"]:
        base_scores = {p: [scores[(baseline, p)][i] for i in common[p]] for p in positions}
        base_worst = position_summary(base_scores)["worst_position"]
    for method in methods:
        per_position = {p: [scores[(method, p)][i] for i in common[p]] for p in positions}
        stats = position_summary(per_position)
        entry: dict[str, Any] = {**stats, "ci": {}, "p_vs_baseline": {}}
        for p in positions:
            entry["ci"][p] = bootstrap_ci(per_position[p])
            if summary["baseline"] and method != baseline:
                base = [scores[(baseline, p)][i] for i in common[p]]
                entry["p_vs_baseline"][p] = paired_test(per_position[p], base)
        # The average, paired per example: each example's mean over the positions (examples
        # scored at every position only).
        flat = [sum(scores[(method, p)][i] for p in positions) / len(positions) for i in everywhere]
        entry["average_ci"] = bootstrap_ci(flat) if flat else None
        if summary["baseline"] and method != baseline and flat:
            base = [sum(scores[(baseline, p)][i] for p in positions) / len(positions) for i in everywhere]
            entry["p_average_vs_baseline"] = paired_test(flat, base)
        if base_worst is not None and method != baseline:
            # The worst positions compared as a target states them ("the worst position beats the
            # unmodified model's worst"): each example at this method's worst position against the
            # same example at the baseline's, which may be another position.
            mine = stats["worst_position"]
            theirs = set(common[base_worst])
            shared = [i for i in common[mine] if i in theirs]
            entry["p_worst_vs_baseline"] = paired_test(
                [scores[(method, mine)][i] for i in shared],
                [scores[(baseline, base_worst)][i] for i in shared],
            )
        summary["methods"][method] = entry
    return summary


def gold_placement(records: Sequence[dict[str, Any]]) -> dict[str, dict[int, dict[str, float]]]:
    """For each method that reorders documents: per gold position, the share of its items whose
    prompt had the gold first (`first`), moved it at all (`moved`), left it out (`dropped`: a
    method that reads only some documents) and read it a second time (`again`: a method that
    repeats a document), and how many."""
    counts: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0, 0, 0]))
    for record in records:
        if "prompt_position" not in record:
            continue
        position, placed = int(record["position"]), record["prompt_position"]
        tally = counts[record["method"]][position]
        tally[0] += placed == 0
        tally[1] += placed != position
        tally[2] += placed is None
        tally[3] += list(record.get("documents_read") or []).count(position) > 1
        tally[4] += 1
    return {
        method: {
            position: {
                "first": first / n,
                "moved": moved / n,
                "dropped": dropped / n,
                "again": again / n,
                "items": n,
            }
            for position, (first, moved, dropped, again, n) in sorted(by_position.items())
        }
        for method, by_position in counts.items()
        if any(moved or again for _, moved, _, again, _ in by_position.values())
    }


def _placement_cell(share: dict[str, float]) -> str:
    cell = f"{100 * share['first']:.0f} % of {share['items']:.0f}"
    if share.get("again"):
        cell += f", read again {100 * share['again']:.0f} %"
    return cell + (f" ({100 * share['dropped']:.0f} % left out)" if share["dropped"] else "")


def placement_table(placement: dict[str, dict[int, dict[str, float]]]) -> str:
    """The share of items with the gold first, per method and gold position, as Markdown."""
    if not placement:
        return ""
    positions = sorted({p for by_position in placement.values() for p in by_position})
    lines = [
        "| method | " + " | ".join(f"pos {p}" for p in positions) + " |",
        "|---|" + "---|" * len(positions),
    ]
    for method, by_position in placement.items():
        shares = [by_position.get(p) for p in positions]
        cells = [_placement_cell(x) if x else "-" for x in shares]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    note = "Items whose prompt had the gold document first, by the gold position the sweep set."
    if any(x.get("again") for by_position in placement.values() for x in by_position.values()):
        note += " Read again: items whose prompt read the gold a second time after the last document."
    if any(x["dropped"] for by_position in placement.values() for x in by_position.values()):
        note += (
            " Left out: items whose prompt did not hold the gold at all (a method that reads only"
            " some documents)."
        )
    return "\n".join(lines) + f"\n\n{note}\n"


def _natural(text: str) -> tuple[Any, ...]:
    return tuple(int(part) if part.isdigit() else part for part in text.replace("-", " ").split())


def markdown_table(summary: dict[str, Any]) -> str:
    """Methods x positions, each cell `mean [CI low, high]`, then average, worst, gap, p vs baseline."""
    metric = summary["metric"]
    percent = metric != "gold_logprob"
    positions = summary["positions"]

    def fmt(value: float) -> str:
        return f"{100 * value:.1f}" if percent else f"{value:.2f}"

    header = ["method", *(f"pos {p}" for p in positions), "average", "worst", "gap"]
    if summary["baseline"]:
        header += [f"p avg vs {summary['baseline']}", f"p worst vs {summary['baseline']}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, entry in summary["methods"].items():
        cells = [method]
        for p in positions:
            low, high = entry["ci"][p]
            mark = "*" if entry["p_vs_baseline"].get(p, 1.0) < 0.05 else ""
            cells.append(f"{fmt(entry['accuracy'][p])}{mark} [{fmt(low)}, {fmt(high)}]")
        cells += [fmt(entry["average"]), fmt(entry["worst"]), fmt(entry["gap"])]
        if summary["baseline"]:
            for key in ("p_average_vs_baseline", "p_worst_vs_baseline"):
                p_value = entry.get(key)
                cells.append("-" if p_value is None else f"{p_value:.3g}")
        lines.append("| " + " | ".join(cells) + " |")
    counts = sorted(set(summary["examples_per_position"].values()))
    unit = "%" if percent else "nats"
    note = (
        f"{METRIC_LABELS.get(metric, metric)} ({unit}) by gold position (0 = first document); "
        f"{' / '.join(map(str, counts))} examples per position; [95% bootstrap CI]; "
        "gap = best minus worst position"
    )
    if summary["baseline"]:
        note += (
            f"; * = differs from {summary['baseline']} at that position (paired test, p < 0.05); p worst: "
            f"each method's worst position against {summary['baseline']}'s worst, paired by example"
        )
    return "\n".join(lines) + f"\n\n{note}.\n"


def line_plot(
    series: dict[str, dict[int, float]],
    path: Path,
    *,
    xlabel: str,
    ylabel: str,
    errors: dict[str, dict[int, tuple[float, float]]] | None = None,
    log_y: bool = False,
    title: str = "",
) -> None:
    """One line per name over integer x, with optional (low, high) error bars; PNG through Agg."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    xs_all = sorted({x for values in series.values() for x in values})
    # Error bars of several methods at one x would hide each other: shift each method a little.
    step = min((b - a for a, b in zip(xs_all, xs_all[1:], strict=False)), default=1)
    for number, (name, values) in enumerate(series.items()):
        xs = sorted(values)
        ys = [values[x] for x in xs]
        if errors and name in errors:
            shift = (number - (len(series) - 1) / 2) * 0.06 * step
            bars = [
                [y - errors[name][x][0] for x, y in zip(xs, ys, strict=True)],
                [errors[name][x][1] - y for x, y in zip(xs, ys, strict=True)],
            ]
            axes.errorbar([x + shift for x in xs], ys, yerr=bars, marker="o", capsize=3, label=name)
        else:
            axes.plot(xs, ys, marker="o", label=name)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    if len(xs_all) <= 12:
        axes.set_xticks(xs_all)
    if log_y:
        axes.set_yscale("log")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if title:
        axes.set_title(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def plot(summary: dict[str, Any], path: Path, title: str = "") -> None:
    """Accuracy against gold position, one line per method, with CI bars."""
    percent = summary["metric"] != "gold_logprob"
    scale = 100.0 if percent else 1.0
    series = {
        method: {p: scale * entry["accuracy"][p] for p in summary["positions"]}
        for method, entry in summary["methods"].items()
    }
    errors = {
        method: {p: (scale * entry["ci"][p][0], scale * entry["ci"][p][1]) for p in summary["positions"]}
        for method, entry in summary["methods"].items()
    }
    unit = " (%)" if percent else " (nats)"
    line_plot(
        series,
        path,
        xlabel="gold document position (0 = first)",
        ylabel=METRIC_LABELS.get(summary["metric"], summary["metric"]) + unit,
        errors=errors,
        title=title,
    )


def write_report(
    folder: Path,
    metric: str | None = None,
    baseline: str = "none",
    methods: Sequence[str] | None = None,
    out: Path | None = None,
    leave_out: Path | None = None,
) -> dict[str, Any]:
    """Write summary.json (every metric), table.md and the plot (the chosen metric) into `out`
    (default: `folder`).

    methods: report only these labels, on the examples they all have (a run whose labels were
    added at different times can be reported for its complete labels at their full size);
    `LABEL=NAME` shows a label under another name (`baseline` is then the name shown).
    leave_out: a file of example ids, one per line, whose records the report leaves out (the
    questions a choice was made on, to report on the ones it never saw)."""
    folder = Path(folder)
    out = Path(out) if out is not None else folder
    if out.resolve() != folder.resolve():  # into a new folder, or one a report was written into
        if (out / MANIFEST_FILE).is_file():
            raise ValueError(
                f"{out} holds another run, whose report this would replace; give --out a new folder."
            )
        check_output_folder(out, SUMMARY_FILE, is_ours=_json_with("run", "main_metric", "metrics"))
    records = read_run_records(folder)
    if not records:
        raise ValueError(f"{folder} has no results yet; run a sweep into it first.")
    left_out = example_ids(leave_out) if leave_out is not None else None
    if left_out is not None:
        records = [r for r in records if str(r["example_id"]) not in left_out]
        if not records:
            raise ValueError(f"{leave_out} lists every example of {folder}; nothing is left to report.")
    manifest = read_manifest(folder) or {}
    order = list(manifest.get("sweep", {}).get("methods", []))
    if methods:
        shown = shown_names(methods)
        labels = list(dict.fromkeys(r["method"] for r in records))
        unknown = [m for m in shown if m not in labels]
        if unknown:
            raise ValueError(
                f"{folder} has no records for {', '.join(unknown)}; its labels are {', '.join(labels)}."
            )
        records = [{**r, "method": shown[r["method"]]} for r in records if r["method"] in shown]
        order = list(shown.values())
    metrics = available_metrics(records)
    if metric is not None and metric not in metrics:
        raise ValueError(f"{folder} has no {metric!r} scores; it has {', '.join(metrics)}.")
    chosen = metric or metrics[0]
    summaries = {m: summarize(records, m, baseline=baseline, method_order=order) for m in metrics}
    sweep = manifest.get("sweep", {})
    document = {
        "run": str(folder),
        "sweep": sweep,
        "model": manifest.get("model", {}).get("name"),
        "records": len(records),
        "main_metric": chosen,
        "metrics": summaries,
    }
    if left_out is not None:
        document["left_out"] = {"file": str(leave_out), "examples": len(left_out)}
    placement = gold_placement(records)
    if placement:
        document["gold_placement"] = placement
    out.mkdir(parents=True, exist_ok=True)
    (out / SUMMARY_FILE).write_text(json.dumps(document, indent=2, default=str) + "\n")
    tables = [f"### {METRIC_LABELS.get(m, m)}\n\n{markdown_table(summaries[m])}" for m in [chosen, *metrics]]
    if placement:
        tables.append(f"### Where the gold document was read\n\n{placement_table(placement)}")
    (out / TABLE_FILE).write_text("\n".join(dict.fromkeys(tables)))
    model = document["model"] or sweep.get("model") or DEFAULT_MODEL
    title = f"{model}: {sweep.get('task', '')}, {sweep.get('num_documents', '?')} documents"
    plot(summaries[chosen], out / PLOT_FILE, title=title.strip())
    return document


def _json_with(*keys: str) -> Callable[[Path], bool]:
    """Whether a file is a JSON object holding `keys`: what tells the summary.json a report wrote
    (or a comparison's file) from a user's file of that name."""

    def holds(path: Path) -> bool:
        try:
            written = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        return isinstance(written, dict) and set(keys) <= written.keys()

    return holds


def example_ids(path: Path) -> set[str]:
    """The example ids a file lists, one per line (blank lines and `#` comments skipped)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise ValueError(f"Cannot read the example ids in {path}: {error.strerror or error}.") from error
    ids = {line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")}
    if not ids:
        raise ValueError(f"{path} lists no example ids; write one per line.")
    return ids


def shown_names(methods: Sequence[str]) -> dict[str, str]:
    """label -> the name a report shows it under, from `LABEL` or `LABEL=NAME` entries."""
    shown: dict[str, str] = {}
    for entry in methods:
        label, _, name = entry.partition("=")
        if not label or (name == "" and "=" in entry):
            raise ValueError(f"{entry!r}: write a label, or LABEL=NAME to show it as NAME.")
        shown[label] = name or label
    if len(set(shown.values())) < len(shown):
        raise ValueError(f"Two labels would be shown under one name: {', '.join(methods)}.")
    return shown


_PERCENT = ("choice_correct", "match", "score")


def compare_runs(
    a: Path, b: Path, metric: str | None = None, out: str | Path | None = None
) -> dict[str, Any]:
    """Per method both runs have: per-group (a sweep's position, a suite's task, ...) difference
    b - a, and a paired test on the items both runs scored (same example ids, windows, ...).
    Both runs must be of one kind."""
    a, b = Path(a), Path(b)
    kind, other = folder_kind(a), folder_kind(b)
    if other != kind:
        raise ValueError(f"{a} holds a {kind} run and {b} a {other} run; compare runs of one kind.")
    pairing = Evaluation.registry[kind].pairing
    records_a, records_b = read_run_records(a), read_run_records(b)
    if not records_a or not records_b:
        raise ValueError(f"Both {a} and {b} need results; run them first.")

    def scored(records: Sequence[dict[str, Any]]) -> list[str]:
        return [m for m in pairing.metrics if any(m in r for r in records)]

    shared = [m for m in scored(records_a) if m in scored(records_b)]
    if metric is not None and metric not in shared:
        raise ValueError(
            f"{metric!r} is not scored in both runs; both have {', '.join(shared) or 'nothing'}."
        )
    if not shared:
        raise ValueError(f"{a} and {b} share no metric to compare.")
    chosen = metric or shared[0]
    group_name = pairing.group or "all"

    def table(records: Sequence[dict[str, Any]]) -> dict[tuple[str, Any], dict[str, float]]:
        found: dict[tuple[str, Any], dict[str, float]] = defaultdict(dict)
        for r in records:
            if chosen in r:
                item = "/".join(str(r[field]) for field in pairing.item)
                found[(r["method"], r[pairing.group] if pairing.group else "all")][item] = float(r[chosen])
        return found

    table_a, table_b = table(records_a), table(records_b)
    rows = []
    for key in sorted(set(table_a) & set(table_b), key=lambda k: (k[0], _natural(str(k[1])))):
        ids = sorted(set(table_a[key]) & set(table_b[key]), key=_natural)
        if not ids:
            continue
        xs, ys = [table_a[key][i] for i in ids], [table_b[key][i] for i in ids]
        rows.append(
            {
                "method": key[0],
                group_name: key[1],
                "examples": len(ids),
                "a": sum(xs) / len(xs),
                "b": sum(ys) / len(ys),
                "difference": (sum(ys) - sum(xs)) / len(ids),
                "p": paired_test(ys, xs),
            }
        )
    if not rows:
        raise ValueError(f"{a} and {b} have no (method, {group_name}, item) in common to compare.")
    scale, digits = (100.0, ".1f") if chosen in _PERCENT else (1.0, ".4g")
    lines = [
        f"{METRIC_LABELS.get(chosen, chosen)}: A = {a}, B = {b}",
        "",
        f"| method | {group_name} | examples | A | B | B - A | p |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['method']} | {row[group_name]} | {row['examples']} | {scale * row['a']:{digits}} | "
            f"{scale * row['b']:{digits}} | {scale * row['difference']:+{digits}} | {row['p']:.3g} |"
        )
    result: dict[str, Any] = {
        "kind": kind,
        "metric": chosen,
        "a": str(a),
        "b": str(b),
        "rows": rows,
        "markdown": "\n".join(lines) + "\n",
    }
    if out is not None:
        target = Path(out)
        check_output_folder(target, COMPARISON_FILE, is_ours=_json_with("kind", "a", "b", "rows"))
        target.mkdir(parents=True, exist_ok=True)
        (target / COMPARISON_FILE).write_text(json.dumps(result, indent=2) + "\n")
        (target / "comparison.md").write_text(result["markdown"])
    return result
