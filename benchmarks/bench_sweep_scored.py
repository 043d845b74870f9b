"""Prompts per hour of a `--metrics loglik generate` sweep: greedy answers and the gold answer's
log-likelihood from one prefill per prompt (`Engine.generate_and_score`, what sweeps do now)
against answering and then scoring, each prefilling the prompt (before).

    python benchmarks/bench_sweep_scored.py --questions 2 --repeats 3 --threads 1

The prompts are a sweep's (`bench_sweep_generate.py`): real NQ-open questions with 10 documents,
the gold at each of `--positions`, answered as a sweep answers them (`score_generation`: greedy,
`--decode-batch` rows decoded together, stop at the first newline, `--max-new-tokens`). The two
paths alternate in one process, `--repeats` times; the median seconds give prompts per hour.
Also reported: answers that differ between the paths, and the largest difference of the gold
log-likelihood per token (bf16 rounds a whole prompt's forward and a shared-start forward apart).
One JSON line on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from bench_sweep_generate import VALIDATION

PATHS = ("apart", "one-prefill")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--positions", type=int, nargs="+", default=[0, 3, 6, 9])
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from rag_mspoe import load_model
    from rag_mspoe.engine import Engine
    from rag_mspoe.eval.data.loaders import load_qa
    from rag_mspoe.eval.data.records import with_gold_at
    from rag_mspoe.eval.scoring.model_scores import score_generation
    from rag_mspoe.eval.sweep.batch_scorer import prompt_of

    model, tokenizer = load_model(args.model, dtype="bfloat16", threads=args.threads)
    engine = Engine(model, tokenizer, method="none")
    examples = [with_gold_at(e, p) for e in load_qa(VALIDATION)[: args.questions] for p in args.positions]
    texts = [prompt_of(example) for example in examples]
    gold = [example.answers[0] for example in examples]
    generation = {"method": None, "max_new_tokens": args.max_new_tokens, "batch_size": args.decode_batch}

    def apart() -> list[dict[str, Any]]:
        scored = score_generation(engine, texts, examples, **generation)
        likelihoods = engine.score_prompts(
            [(text, [answer]) for text, answer in zip(texts, gold, strict=True)]
        )
        for item, ((total, tokens),) in zip(scored, likelihoods, strict=True):
            item.update(gold_logprob=total, gold_tokens=tokens)
        return scored

    def one_prefill() -> list[dict[str, Any]]:
        return score_generation(engine, texts, examples, gold=gold, **generation)

    runs = {"apart": apart, "one-prefill": one_prefill}
    seconds: dict[str, list[float]] = {path: [] for path in PATHS}
    results: dict[str, list[dict[str, Any]]] = {}
    for repeat in range(args.repeats):
        for path in PATHS if repeat % 2 == 0 else PATHS[::-1]:
            started = time.perf_counter()
            results[path] = runs[path]()
            seconds[path].append(time.perf_counter() - started)
            print(f"repeat {repeat + 1} {path}: {seconds[path][-1]:.1f} s", file=sys.stderr)
    per_hour = {path: round(len(texts) * 3600 / statistics.median(s), 1) for path, s in seconds.items()}
    pairs = list(zip(results["apart"], results["one-prefill"], strict=True))
    print(
        json.dumps(
            {
                "model": args.model,
                "threads": args.threads,
                "sweep_scored_speedup": round(per_hour["one-prefill"] / per_hour["apart"], 2),
                "prompts": len(texts),
                "mean_prompt_tokens": round(statistics.fmean(engine.count_tokens(t) for t in texts), 1),
                "prompts_per_hour": per_hour,
                "answers_differing": sum(a["prediction"] != b["prediction"] for a, b in pairs),
                "max_abs_gold_loglik_diff_per_token": round(
                    max(abs(a["gold_logprob"] - b["gold_logprob"]) / a["gold_tokens"] for a, b in pairs), 4
                ),
                "seconds": {path: [round(s, 1) for s in values] for path, values in seconds.items()},
                "load_average": [round(x, 2) for x in os.getloadavg()],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
