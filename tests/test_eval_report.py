"""Reports from results files: the summary's numbers, the Markdown table, the PNG, comparing runs."""

from __future__ import annotations

import json

import pytest

from rag_mspoe.eval.report import compare_runs, summarize, write_report
from rag_mspoe.eval.runs.results import RESULTS_FILE


def write_results(folder, scores):
    """scores: {(method, position): [0/1 per example]} written as sweep records."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / RESULTS_FILE, "w") as handle:
        for (method, position), values in scores.items():
            for index, value in enumerate(values):
                record = {
                    "method": method,
                    "position": position,
                    "example_id": f"ex-{index}",
                    "choice_correct": float(value),
                    "gold_logprob": -1.0 - index - (0 if value else 5),
                }
                handle.write(json.dumps(record) + "\n")
    return folder


def scores_of(accuracy, n=20):
    """n 0/1 scores with the given accuracy, correct ones first."""
    correct = round(accuracy * n)
    return [1] * correct + [0] * (n - correct)


SCORES = {
    ("none", 0): scores_of(0.8),
    ("none", 4): scores_of(0.2),
    ("none", 9): scores_of(0.4),
    ("mspoe", 0): scores_of(0.5),
    ("mspoe", 4): scores_of(0.35),
    ("mspoe", 9): scores_of(0.4),
}


def test_summary_has_per_position_accuracy_average_worst_gap_and_paired_tests(tmp_path):
    write_results(tmp_path, SCORES)
    summary = write_report(tmp_path)["metrics"]["choice_correct"]
    none, mspoe = summary["methods"]["none"], summary["methods"]["mspoe"]
    assert none["accuracy"] == {0: 0.8, 4: 0.2, 9: 0.4}
    assert none["average"] == pytest.approx(1.4 / 3) and none["worst_position"] == 4
    assert none["gap"] == pytest.approx(0.6) and mspoe["gap"] == pytest.approx(0.15)
    low, high = none["ci"][0]
    assert low < 0.8 < high
    # mspoe loses 6 of none's correct answers at position 0 and wins none there.
    assert mspoe["p_vs_baseline"][0] < 0.05 and mspoe["p_vs_baseline"][9] == 1.0
    assert "p_vs_baseline" in none and not none["p_vs_baseline"]


def test_the_worst_positions_are_compared_as_a_target_states_them(tmp_path):
    # A method at 60 % everywhere (its worst position is then the first: ties go to the earliest),
    # its correct answers on other examples at position 4, against none's worst (position 4). The
    # test pairs each example at the two worst positions: 8 wins and no loss.
    flat = {("flat", 0): scores_of(0.6), ("flat", 4): scores_of(0.6)[::-1], ("flat", 9): scores_of(0.6)}
    write_results(tmp_path, {**SCORES, **flat})
    summary = write_report(tmp_path)["metrics"]["choice_correct"]["methods"]
    assert summary["flat"]["worst_position"] == 0 and summary["none"]["worst_position"] == 4
    assert summary["flat"]["p_worst_vs_baseline"] == pytest.approx(2 / 2**8)
    # Not the comparisons at one position: 0 wins, 4 losses at 0; 12 wins, 4 losses at 4.
    assert summary["flat"]["p_vs_baseline"][0] == pytest.approx(2 / 2**4)
    assert summary["flat"]["p_vs_baseline"][4] == pytest.approx(2 * (1 + 16 + 120 + 560 + 1820) / 2**16)
    assert "p_worst_vs_baseline" not in summary["none"]
    row = next(
        line for line in (tmp_path / "table.md").read_text().splitlines() if line.startswith("| flat |")
    )
    assert row.endswith("| 0.00781 |")


def test_markdown_table_and_plot_are_written(tmp_path):
    write_results(tmp_path, SCORES)
    write_report(tmp_path)
    table = (tmp_path / "table.md").read_text()
    header = "| method | pos 0 | pos 4 | pos 9 | average | worst | gap | p avg vs none | p worst vs none |"
    assert header in table
    assert "| none | 80.0 [" in table and "| mspoe | 50.0* [" in table
    assert "20 examples per position" in table and "gold answer log-likelihood" in table
    png = (tmp_path / "accuracy_by_position.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["main_metric"] == "choice_correct" and saved["records"] == 120


def test_the_report_says_where_a_reordering_put_the_gold(tmp_path):
    write_results(tmp_path, SCORES)
    records = [json.loads(line) for line in (tmp_path / RESULTS_FILE).read_text().splitlines()]
    for record in records:
        # none reads the gold where the sweep put it; "mspoe" stands for a reordering here that
        # leaves it in place in 1 example of 4, leaves it out (reads only some documents) in 1 and
        # puts it first in the others.
        kind = int(record["example_id"].split("-")[1]) % 4
        if record["method"] == "mspoe" and kind:
            record["prompt_position"] = None if kind == 1 else 0
        else:
            record["prompt_position"] = record["position"]
    (tmp_path / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    placement = write_report(tmp_path)["gold_placement"]
    assert list(placement) == ["mspoe"]  # none moved nothing
    assert placement["mspoe"][4] == {"first": 0.5, "moved": 0.75, "dropped": 0.25, "again": 0.0, "items": 20}
    # At position 0 a gold left in place is first too; only leaving it out moved it.
    assert placement["mspoe"][0] == {"first": 0.75, "moved": 0.25, "dropped": 0.25, "again": 0.0, "items": 20}
    table = (tmp_path / "table.md").read_text()
    assert "### Where the gold document was read" in table
    assert "| mspoe | 75 % of 20 (25 % left out) | 50 % of 20 (25 % left out) |" in table
    assert "Left out: items whose prompt did not hold the gold" in table


def test_the_report_says_how_often_a_repeating_method_read_the_gold_again(tmp_path):
    write_results(tmp_path, SCORES)
    records = [json.loads(line) for line in (tmp_path / RESULTS_FILE).read_text().splitlines()]
    for record in records:
        # "mspoe" stands for a method that keeps every document in place and reads one again after
        # the last: the gold in 1 example of 2, another document in the others.
        record["prompt_position"] = record["position"]
        if record["method"] == "mspoe":
            gold = record["position"]
            again = gold if int(record["example_id"].split("-")[1]) % 2 else (gold + 1) % 10
            record["documents_read"] = [*range(10), again]
    (tmp_path / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    placement = write_report(tmp_path)["gold_placement"]
    assert list(placement) == ["mspoe"]
    assert placement["mspoe"][4] == {"first": 0.0, "moved": 0.0, "dropped": 0.0, "again": 0.5, "items": 20}
    table = (tmp_path / "table.md").read_text()
    assert "| mspoe | 100 % of 20, read again 50 % | 0 % of 20, read again 50 % |" in table
    assert "Read again: items whose prompt read the gold a second time" in table


def test_only_examples_every_method_has_count(tmp_path):
    records = [
        {"method": "none", "position": 0, "example_id": "a", "choice_correct": 1.0},
        {"method": "none", "position": 0, "example_id": "b", "choice_correct": 1.0},
        {"method": "pi", "position": 0, "example_id": "a", "choice_correct": 0.0},
    ]
    summary = summarize(records, "choice_correct")
    assert summary["examples_per_position"] == {0: 1}
    assert summary["methods"]["none"]["accuracy"] == {0: 1.0}


def test_a_label_added_on_fewer_examples_can_be_left_out_of_the_report(tmp_path):
    scores = {**SCORES, ("pine", 0): [1] * 5, ("pine", 4): [1] * 5, ("pine", 9): [1] * 5}
    write_results(tmp_path, scores)
    every = write_report(tmp_path)["metrics"]["choice_correct"]
    assert every["examples_per_position"] == {0: 5, 4: 5, 9: 5}
    complete = write_report(tmp_path, methods=["mspoe", "none"], out=tmp_path / "complete")
    summary = complete["metrics"]["choice_correct"]
    assert summary["examples_per_position"] == {0: 20, 4: 20, 9: 20}
    assert list(summary["methods"]) == ["mspoe", "none"]
    assert summary["methods"]["none"]["accuracy"] == {0: 0.8, 4: 0.2, 9: 0.4}
    assert (tmp_path / "complete" / "table.md").is_file()
    assert (tmp_path / "complete" / "accuracy_by_position.png").is_file()


def test_a_label_can_be_shown_under_another_name(tmp_path):
    write_results(tmp_path, SCORES)
    plain = write_report(tmp_path, methods=["none", "mspoe"], out=tmp_path / "plain")["metrics"]
    named = write_report(tmp_path, methods=["none", "mspoe=shipped"], out=tmp_path / "named")["metrics"]
    assert list(named["choice_correct"]["methods"]) == ["none", "shipped"]
    assert named["choice_correct"]["methods"]["shipped"] == plain["choice_correct"]["methods"]["mspoe"]
    table = (tmp_path / "named" / "table.md").read_text()
    assert "| shipped |" in table and "mspoe" not in table
    # The baseline is named as shown.
    renamed = write_report(tmp_path, methods=["none=base", "mspoe"], baseline="base", out=tmp_path / "b")
    assert renamed["metrics"]["choice_correct"]["baseline"] == "base"
    for bad, message in (
        (["mspoe="], "LABEL=NAME"),
        (["=x"], "LABEL=NAME"),
        (["none=a", "mspoe=a"], "shown under one name"),
        (["pine=x"], "no records for pine"),
    ):
        with pytest.raises(ValueError, match=message):
            write_report(tmp_path, methods=bad, out=tmp_path / "bad")


def test_an_empty_run_and_a_missing_metric_are_explained(tmp_path):
    with pytest.raises(ValueError, match="no results yet"):
        write_report(tmp_path)
    write_results(tmp_path, SCORES)
    with pytest.raises(ValueError, match="no 'match' scores"):
        write_report(tmp_path, metric="match")


def test_compare_two_runs_per_method_and_position(tmp_path):
    a = write_results(tmp_path / "a", SCORES)
    b = write_results(tmp_path / "b", {**SCORES, ("mspoe", 4): scores_of(0.6)})
    result = compare_runs(a, b, out=tmp_path / "cmp")
    rows = {(r["method"], r["position"]): r for r in result["rows"]}
    assert rows[("mspoe", 4)]["difference"] == pytest.approx(0.25)
    assert rows[("none", 0)]["difference"] == 0 and rows[("none", 0)]["p"] == 1.0
    assert "| mspoe | 4 | 20 | 35.0 | 60.0 | +25.0 |" in (tmp_path / "cmp" / "comparison.md").read_text()
    other = write_results(tmp_path / "c", {("yarn", 0): [1]})
    with pytest.raises(ValueError, match="nothing in common|no \\(method"):
        compare_runs(a, other)
