"""Two sweeps of the same questions, paired question by question: did a change of the model (a
`--quantize` scheme, a dtype) change the answers?

    python benchmarks/compare_paired_runs.py runs/bf16 runs/int8-prompt

For each method and gold position both runs scored: exact match in each, the questions only one
of them answered right (McNemar's exact test), the predictions that are the same text, and
the gold answer's log-likelihood change per token (mean and max). One JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from rag_mspoe.eval.runs.results import SWEEP_KEY, Key, read_run_records
from rag_mspoe.eval.scoring.metrics import paired_test


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("before", type=Path, help="the reference run's folder")
    parser.add_argument("after", type=Path, help="the changed run's folder")
    args = parser.parse_args()
    before, after = records(args.before), records(args.after)
    groups = sorted({key[:2] for key in before.keys() & after.keys()})
    print(
        json.dumps(
            {
                f"{method} at {position}": paired(before, after, method, position)
                for method, position in groups
            }
        )
    )


def records(folder: Path) -> dict[Key, dict[str, Any]]:
    """The run's records by (method, gold position, example), from results.jsonl or its .gz."""
    return {tuple(row[field] for field in SWEEP_KEY): row for row in read_run_records(folder)}


def paired(before: dict, after: dict, method: str, position: int) -> dict[str, Any]:
    keys = sorted(key for key in before.keys() & after.keys() if key[:2] == (method, position))
    gained = sum(after[key]["match"] > before[key]["match"] for key in keys)
    lost = sum(after[key]["match"] < before[key]["match"] for key in keys)
    moved = [
        abs(after[key]["gold_logprob"] - before[key]["gold_logprob"]) / before[key]["gold_tokens"]
        for key in keys
        if "gold_logprob" in before[key]
    ]
    return {
        "questions": len(keys),
        "exact_match": [
            round(statistics.fmean(run[key]["match"] for key in keys), 3) for run in (before, after)
        ],
        "right_only_after": gained,
        "right_only_before": lost,
        # McNemar's exact test on the exact-match verdicts, as the sweep reports use.
        "paired_p": round(
            paired_test([before[k]["match"] for k in keys], [after[k]["match"] for k in keys]), 3
        ),
        "same_prediction": sum(after[key]["prediction"] == before[key]["prediction"] for key in keys),
        "gold_loglik_change_per_token": {
            "mean": round(statistics.fmean(moved), 4),
            "max": round(max(moved), 4),
        }
        if moved
        else None,
    }


if __name__ == "__main__":
    main()
