"""Examples per second of the batched sweep runner against a one-example-at-a-time loop, same sweep.

    python benchmarks/bench_eval.py --documents 10 --samples 8 --positions 0,9 --methods none,mspoe

Both score the same (method, position, example) items with greedy generation (best_subspan_em):
the runner in left-padded batches of --batch-size prompts, the loop with one `engine.generate`
call per item. Prints both rates, their ratio, and how often the two agree on the score (left
padding can change a near-tie in greedy decoding). The model is loaded once and shared.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--documents", type=int, default=10)
    parser.add_argument("--samples", type=int, default=8, help="examples per position")
    parser.add_argument("--positions", default="0,9")
    parser.add_argument("--methods", default="none,mspoe")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from rag_mspoe import load_model
    from rag_mspoe.engine import Engine
    from rag_mspoe.eval.runs.results import read_records
    from rag_mspoe.eval.scoring.metrics import best_subspan_em
    from rag_mspoe.eval.sweep.batch_scorer import arranged_example, prompt_of
    from rag_mspoe.eval.sweep.plan import SweepConfig, load_examples
    from rag_mspoe.eval.sweep.run import run_sweep
    from rag_mspoe.methods.method_spec import resolve_all

    model, tokenizer = load_model(args.model, threads=args.threads)
    config = SweepConfig(
        num_documents=args.documents,
        positions=tuple(int(p) for p in args.positions.split(",")),
        methods=tuple(args.methods.split(",")),
        samples=args.samples,
        metrics=("generate",),
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        model=args.model,
    )
    items = len(config.methods) * len(config.positions) * config.samples

    with tempfile.TemporaryDirectory(prefix="bench-eval-") as scratch:
        started = time.perf_counter()
        run_sweep(config, scratch, model=model, tokenizer=tokenizer, progress=False, report=False)
        batched_seconds = time.perf_counter() - started
        records = read_records(Path(scratch) / "results.jsonl")
        batched = {(r["method"], r["position"], r["example_id"]): r["match"] for r in records}

    engine = Engine(model, tokenizer, method="none")
    examples = load_examples(config)
    looped = {}
    started = time.perf_counter()
    for method in resolve_all(config.methods):
        for position in config.positions:
            for example in examples:
                arranged, _ = arranged_example(method, example, position, config.seed)
                answer = engine.generate(
                    prompt_of(arranged), max_new_tokens=args.max_new_tokens, stop=["\n"], method=method.method
                )
                looped[(method.name, position, example.id)] = best_subspan_em(answer.text, example.answers)
    loop_seconds = time.perf_counter() - started

    agree = sum(batched[key] == looped[key] for key in looped) / len(looped)
    result = {
        "items": items,
        "documents": args.documents,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "batched_examples_per_s": round(items / batched_seconds, 3),
        "loop_examples_per_s": round(items / loop_seconds, 3),
        "speedup": round(loop_seconds / batched_seconds, 2),
        "score_agreement": round(agree, 3),
        "batched_accuracy": round(sum(batched.values()) / items, 3),
        "loop_accuracy": round(sum(looped.values()) / items, 3),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
