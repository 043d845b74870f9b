"""How often each score, and each standardised sum of two, puts the gold document first, and the
questions each wins and loses against the question's likelihood alone: `python analyze.py`."""

import gzip
import json
from pathlib import Path

import numpy as np


def standardised(values):
    values = np.asarray(values, dtype=float)
    return (values - values.mean()) / values.std() if values.std() > 0 else values * 0


RANKINGS = {
    "question likelihood (invariant-reorder's default)": lambda r: r["question_likelihood"],
    "judge, short prompt": lambda r: r["judge"],
    "judge, in the prompt (score='judge')": lambda r: r["judge_in_prompt"],
    "question likelihood + judge, short prompt": lambda r: (
        standardised(r["question_likelihood"]) + standardised(r["judge"])
    ),
    "question likelihood + judge in the prompt (score='question+judge')": lambda r: (
        standardised(r["question_likelihood"]) + standardised(r["judge_in_prompt"])
    ),
}


def main():
    with gzip.open(Path(__file__).with_name("scores.jsonl.gz"), "rt") as lines:
        records = [json.loads(line) for line in lines]
    hits = {name: [int(np.argmax(rank(r))) == r["gold"] for r in records] for name, rank in RANKINGS.items()}
    baseline = hits["question likelihood (invariant-reorder's default)"]
    print(f"{len(records)} questions")
    for name, hit in hits.items():
        gained = sum(h and not b for h, b in zip(hit, baseline, strict=True))
        lost = sum(b and not h for h, b in zip(hit, baseline, strict=True))
        print(f"{100 * sum(hit) / len(hit):5.1f} %  +{gained} -{lost}  {name}")


if __name__ == "__main__":
    main()
