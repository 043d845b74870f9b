"""Exact match of each order, of the better of the two (an oracle), and of keeping the answer the
model is surer of by several measures of its token log-probabilities: `python analyze.py`."""

import gzip
import json
from pathlib import Path

ENDINGS = ("\u010a", "<|im_end|>", "<|endoftext|>")  # the newline or end of turn that ended an answer
RULES = ("mean", "sum", "min", "first4", "first8")


def confidence(answer: dict, rule: str) -> float:
    logprobs = answer["logprobs"]
    if answer["tokens"] and answer["tokens"][-1] in ENDINGS and len(logprobs) > 1:
        logprobs = logprobs[:-1]
    if rule == "mean":
        return sum(logprobs) / len(logprobs)
    if rule == "sum":
        return sum(logprobs)
    if rule == "min":
        return min(logprobs)
    head = logprobs[: int(rule.removeprefix("first"))]
    return sum(head) / len(head)


def main() -> None:
    with gzip.open(Path(__file__).with_name("answers.jsonl.gz"), "rt") as lines:
        records = [json.loads(line) for line in lines]
    n = len(records)
    first = [r["answers"]["first"] for r in records]
    last = [r["answers"]["last"] for r in records]
    share = {
        "first": sum(a["match"] for a in first),
        "last": sum(a["match"] for a in last),
        "better of the two": sum(max(a["match"], b["match"]) for a, b in zip(first, last, strict=True)),
    }
    print(f"{n} questions; the gold ranked first on {sum(r['ranked'][0] == r['gold'] for r in records)}")
    for name, right in share.items():
        print(f"{name:18s} {100 * right / n:.1f} %")
    for rule in RULES:
        kept = [
            a if confidence(a, rule) >= confidence(b, rule) else b for a, b in zip(first, last, strict=True)
        ]
        gained = sum(k["match"] > a["match"] for k, a in zip(kept, first, strict=True))
        lost = sum(k["match"] < a["match"] for k, a in zip(kept, first, strict=True))
        right = 100 * sum(k["match"] for k in kept) / n
        print(f"surer by {rule:6s}    {right:.1f} % (against first: +{gained} -{lost})")


if __name__ == "__main__":
    main()
