"""Choose the confirmatory run's questions: validation questions no committed run has read.

Every record file under docs/results (sweep records, their example copies, ranking and probe
records) is read for the example ids it holds; the ids that are validation questions (the 780 of
../nq20-1.5b/validation-20.jsonl.gz, the same questions and ids as ../nq10-split/validation-10 and
../nq5-0.5b/validation-5) make read-before-ids.txt. This folder's own records are skipped. The
first 300 validation questions in file order whose id is not in that list, as they stand in
validation-20.jsonl.gz, make validation-20-fresh.jsonl.gz.

    python docs/results/nq20-1.5b-confirm/fresh_questions.py          # write both files
    python docs/results/nq20-1.5b-confirm/fresh_questions.py --check  # compare with them

Run from the repository's root. The files were written at commit d9108b3; a later run that reads
validation questions adds to the list, so --check then reports a difference.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

RESULTS = Path("docs/results")
HERE = RESULTS / "nq20-1.5b-confirm"
VALIDATION = RESULTS / "nq20-1.5b" / "validation-20.jsonl.gz"
SAME_QUESTIONS = [
    RESULTS / "nq10-split" / "validation-10.jsonl.gz",
    RESULTS / "nq5-0.5b" / "validation-5.jsonl.gz",
]
DATA_FILES = {VALIDATION, *SAME_QUESTIONS, RESULTS / "nq10-split" / "search-10.jsonl.gz"}
# Runs started after this protocol was fixed; they choose their questions after these 300.
LATER_RUNS = {RESULTS / "e2e-0.5b"}
COUNT = 300


def lines(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed files")
    args = parser.parse_args()

    validation = lines(VALIDATION)
    ids = [str(r["id"]) for r in validation]
    for other in SAME_QUESTIONS:  # the three validation files hold the same questions, same ids
        if [(str(r["id"]), r["question"]) for r in lines(other)] != [
            (i, r["question"]) for i, r in zip(ids, validation, strict=True)
        ]:
            raise SystemExit(f"{other} does not hold the same questions as {VALIDATION}")
    known = set(ids)

    read: set[str] = set()
    for path in sorted(RESULTS.rglob("*.jsonl*")):
        if path in DATA_FILES or HERE in path.parents or LATER_RUNS & set(path.parents):
            continue
        for record in lines(path):
            for key in ("example_id", "id"):
                if key in record and str(record[key]) in known:
                    read.add(str(record[key]))

    read_list = [i for i in ids if i in read]  # in file order
    fresh = [r for r in validation if str(r["id"]) not in read]
    chosen = fresh[:COUNT]
    print(
        f"{len(ids)} validation questions, {len(read_list)} read before, {len(fresh)} fresh, "
        f"{len(chosen)} chosen (file indices {ids.index(str(chosen[0]['id']))}"
        f"-{ids.index(str(chosen[-1]['id']))})"
    )

    read_text = "".join(f"{i}\n" for i in read_list)
    data_text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in chosen)
    if args.check:
        same_read = (HERE / "read-before-ids.txt").read_text() == read_text
        same_data = [
            json.dumps(r, ensure_ascii=False) for r in lines(HERE / "validation-20-fresh.jsonl.gz")
        ] == [json.dumps(r, ensure_ascii=False) for r in chosen]
        print(
            f"read-before-ids.txt {'matches' if same_read else 'DIFFERS'}; "
            f"validation-20-fresh.jsonl.gz {'matches' if same_data else 'DIFFERS'}"
        )
        return 0 if same_read and same_data else 1
    (HERE / "read-before-ids.txt").write_text(read_text)
    with gzip.GzipFile(HERE / "validation-20-fresh.jsonl.gz", "wb", mtime=0) as f:
        f.write(data_text.encode("utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
