"""Scoring under methods that keep the rows through the documents: the unmodified model's cache of
those rows shared by every method (what sweeps and `calibrate search` do) against each method's
full forward, in one run, on real 10-document NQ-open prompts.

    python benchmarks/bench_document_prefix.py --model qwen2.5-coder-0.5b-instruct --prompts 6

Prints prompt-and-method scores per hour for both paths, the speed-up, and the largest difference
in the gold answer's log-likelihood per token between them, as one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from rag_mspoe import load_model
from rag_mspoe.engine import Engine
from rag_mspoe.eval.data.loaders import load_qa
from rag_mspoe.eval.data.records import with_gold_at
from rag_mspoe.eval.sweep.batch_scorer import prompt_of
from rag_mspoe.methods import AttentionCalibration, Pine

DATA = "docs/results/nq10-split/search-10.jsonl.gz"
METHODS = [
    AttentionCalibration(),
    AttentionCalibration(strength=0.5, layers=list(range(8, 16))),
    AttentionCalibration(temperature=0.2),
    Pine(bidirectional=False),
    Pine(bidirectional=False, important_first=True),
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--data", default=DATA)
    parser.add_argument("--prompts", type=int, default=6, help="questions (each at gold positions 0, 4, 9)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default=None)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, threads=args.threads, dtype=args.dtype)
    engine = Engine(model, tokenizer, method="none")
    examples = load_qa(args.data)[: args.prompts]
    items = [(prompt_of(with_gold_at(ex, p)), [ex.answers[0]]) for ex in examples for p in (0, 4, 9)]
    engine.score_continuations(*items[0], method=METHODS[0])  # the bias estimate, warm-up
    seconds = {"shared": 0.0, "full": 0.0}
    scores: dict[str, list[float]] = {"shared": [], "full": []}
    for index, (prompt, answers) in enumerate(items):
        for path in ("shared", "full"):  # interleaved, so load changes hit both alike
            if path == "full":
                engine._after_documents = lambda *_: False  # type: ignore[method-assign]
            started = time.perf_counter()
            for method in METHODS:
                ((total, tokens),) = engine.score_continuations(prompt, answers, method=method)
                scores[path].append(total / tokens)
            seconds[path] += time.perf_counter() - started
            if path == "full":
                del engine._after_documents
        done = f"shared {seconds['shared']:.1f} s, full {seconds['full']:.1f} s"
        print(f"prompt {index + 1}/{len(items)}: {done}", flush=True)
    scored = len(items) * len(METHODS)
    result = {
        "model": args.model,
        "dtype": str(model.dtype),
        "threads": torch.get_num_threads(),
        "methods": len(METHODS),
        "prompts": len(items),
        "shared_per_hour": round(scored / seconds["shared"] * 3600),
        "full_per_hour": round(scored / seconds["full"] * 3600),
        "speedup": round(seconds["full"] / seconds["shared"], 2),
        "max_abs_loglik_diff": max(abs(a - b) for a, b in zip(scores["shared"], scores["full"], strict=True)),
        "prefixes_computed": engine.document_prefixes.computed,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
