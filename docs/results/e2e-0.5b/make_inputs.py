"""Writes this folder's inputs from the shared NQ-open calibration file (path as the argument):

- `pool.jsonl`: the 1,300 gold passages as `{title, text}` lines, the corpus every setting indexes;
- `questions.jsonl`: the validation questions no committed run has read, as `{id, question, answers}`:
  the 780 of `../nq10-split/validation-10.jsonl.gz`, less the ids `../nq20-1.5b-confirm/` lists as
  read before and the 300 it reads itself; the first 120 of them, in file order.

    python docs/results/e2e-0.5b/make_inputs.py ../shared/data/nq-open-calibration.jsonl.gz
"""

import gzip
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE.parent
QUESTIONS = 120


def jsonl(path: Path | str) -> list[dict]:
    with gzip.open(path, "rt") as lines:
        return [json.loads(line) for line in lines]


def main(calibration_file: str) -> None:
    oracle = jsonl(calibration_file)
    with open(HERE / "pool.jsonl", "w") as pool:
        for record in oracle:
            gold = record["ctxs"][0]
            pool.write(json.dumps({"title": gold["title"], "text": gold["text"]}) + "\n")
    confirm = RESULTS / "nq20-1.5b-confirm"
    read_text = (confirm / "read-before-ids.txt").read_text()
    read = {line.strip() for line in read_text.splitlines() if line.strip()[:1].isdigit()}
    read |= {str(r["id"]) for r in jsonl(confirm / "validation-20-fresh.jsonl.gz")}
    validation = jsonl(RESULTS / "nq10-split" / "validation-10.jsonl.gz")
    fresh = [r for r in validation if str(r["id"]) not in read][:QUESTIONS]
    with open(HERE / "questions.jsonl", "w") as out:
        for r in fresh:
            out.write(
                json.dumps({"id": str(r["id"]), "question": r["question"], "answers": r["answers"]}) + "\n"
            )


if __name__ == "__main__":
    main(sys.argv[1])
