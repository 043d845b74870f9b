"""Seconds per RAG answer under `method="auto"` against the unmodified model and the shipped method
forced on (`calibrated`), on prompts of a document count the shipped method was validated at and of
one it was not: where it was not, "auto" should answer as the unmodified model does, in its time
(no ranking pass); where it was, as "calibrated" does.

    python benchmarks/bench_auto.py --model qwen2.5-coder-1.5b-instruct --prompts 3
    python benchmarks/bench_auto.py --model qwen2.5-coder-0.5b-instruct --prompts 3

Real NQ-open prompts of 10 documents (the search half, as bench_answer.py reads) and of 20 (the
1.5B's first validation file), the gold passage in the middle, greedy 32-token answers, one thread,
the default answering path. Per prompt the three methods take turns in one process: "none", then
"auto", then "calibrated" (which, after "auto" ranked a validated prompt, finds its scores kept and
runs no ranking: compare its time only where "auto" did not rank). One JSON line on stdout: per
prompt the seconds of each, and `auto_answered_as`: "none" or "calibrated" when auto's text and the
order it read equal that method's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from bench_cpu_inference import DATA

TWENTY = Path(__file__).resolve().parents[1] / "docs" / "results" / "nq20-1.5b" / "validation-20.jsonl.gz"
METHODS = ("none", "auto", "calibrated")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="an embedded model's name")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per document count")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--data", nargs="+", default=[str(DATA), str(TWENTY)], help="build-qa files")
    args = parser.parse_args()

    import torch

    from rag_mspoe.engine import Engine
    from rag_mspoe.eval.data.loaders import load_qa
    from rag_mspoe.eval.data.prompts import qa_prompt
    from rag_mspoe.eval.data.records import with_gold_at

    warnings.simplefilter("ignore")  # auto's once-per-count notes; the record says what happened
    torch.set_num_threads(1)
    engine = Engine.load(args.model, threads=1)
    rows = []
    for data in args.data:
        for example in load_qa(data)[: args.prompts]:
            prompt = qa_prompt(with_gold_at(example, len(example.documents) // 2 - 1))
            row: dict[str, Any] = {"documents": len(example.documents)}
            answers = {}
            for method in METHODS:
                started = time.perf_counter()
                answers[method] = engine.generate(prompt, method=method, max_new_tokens=args.new_tokens)
                row[method] = round(time.perf_counter() - started, 2)
            row["auto_answered_as"] = _answered_as(answers)
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    result = {
        "model": args.model,
        "threads": 1,
        "new_tokens": args.new_tokens,
        "validated_documents": list(engine.method_config("calibrated").validated_documents or []),
        "prompts": rows,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(result))


def _answered_as(answers: dict[str, Any]) -> str:
    """Which method's answer (text and order read) auto's equals: "none", "calibrated" or "neither"."""
    auto = answers["auto"]
    for method in ("none", "calibrated"):
        if (auto.text, auto.documents_read) == (answers[method].text, answers[method].documents_read):
            return method
    return "neither"


if __name__ == "__main__":
    main()
