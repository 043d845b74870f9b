"""Prompts per hour of a `--metrics generate` sweep: answers decoded together after prefills one
prompt at a time (today's `generate_batch` on the CPU) against one left-padded batch (before).

    python benchmarks/bench_sweep_generate.py --questions 2 --threads 1
    python benchmarks/bench_decode.py --quick        # runs it too: `sweep_generate_speedup`

The prompts are a sweep's: real NQ-open questions of docs/results/nq10-split/validation-10.jsonl.gz,
10 documents, the gold at each of `--positions`, one sweep batch of every position of the
questions; each is answered as the sweep answers (`score_generation`: greedy, stop at the first
newline, `--max-new-tokens`). Paths: `padded` (the whole batch in one left-padded `generate`,
as sweeps ran before), `joined-N` (`--decode-batch N` answers decoded together, each prompt
prefilled alone; joined-1 answers one prompt at a time), and `whole-N` (joined-N with every
prompt prefilled whole: `Engine.shared_prompt_starts = False`; joined rows prefill a start they
share with an earlier prompt, such as the documents before a later gold, once). They alternate
batch by batch in one process (`--repeats` times), so the machine's changing load hits each
alike; the median seconds per path give prompts per hour. `sweep_generate_speedup`: the best
joined path (N > 1) against the padded one; `..._vs_one_at_a_time` against joined-1;
`shared_starts_speedup`: joined-N against whole-N for the largest N.
Also reported: how many answers differ from the padded path's and from one at a time (bf16
rounds differently in a batch of another shape; fp32 answers are equal:
`tests/test_joined_decode.py`).
One JSON line on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

VALIDATION = (
    Path(__file__).resolve().parents[1] / "docs" / "results" / "nq10-split" / "validation-10.jsonl.gz"
)
PADDED = "padded"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--positions", type=int, nargs="+", default=[0, 3, 6, 9])
    parser.add_argument("--decode-batch", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    from rag_mspoe import load_model

    model, tokenizer = load_model(args.model, dtype="bfloat16", threads=args.threads)
    result = sweep_generate(
        model,
        tokenizer,
        questions=args.questions,
        positions=args.positions,
        decode_batches=args.decode_batch,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
    )
    print(json.dumps({"model": args.model, "threads": args.threads, **result}), flush=True)


def sweep_generate(
    model: Any,
    tokenizer: Any,
    *,
    questions: int = 2,
    positions: list[int] | tuple[int, ...] = (0, 3, 6, 9),
    decode_batches: list[int] | tuple[int, ...] = (1, 8),
    max_new_tokens: int = 64,
    repeats: int = 1,
) -> dict[str, Any]:
    """Seconds and prompts per hour of each path over one sweep batch, and the speed-up of the
    best joined path over the padded one."""
    from rag_mspoe.engine import Engine
    from rag_mspoe.eval.data.loaders import load_qa
    from rag_mspoe.eval.data.records import with_gold_at
    from rag_mspoe.eval.scoring.model_scores import score_generation
    from rag_mspoe.eval.sweep.batch_scorer import prompt_of

    engine = Engine(model, tokenizer, method="none")
    examples = [with_gold_at(e, p) for e in load_qa(VALIDATION)[:questions] for p in positions]
    texts = [prompt_of(example) for example in examples]
    whole = f"whole-{max(decode_batches)}"
    paths = [PADDED, *(f"joined-{n}" for n in decode_batches), whole]
    seconds: dict[str, list[float]] = {path: [] for path in paths}
    answers: dict[str, list[str]] = {}
    for repeat in range(repeats):
        for path in paths if repeat % 2 == 0 else list(reversed(paths)):
            engine.joined_decoding = path != PADDED
            engine.shared_prompt_starts = path != whole
            size = len(texts) if path == PADDED else int(path.split("-")[1])
            started = time.perf_counter()
            scored = score_generation(
                engine, texts, examples, method=None, max_new_tokens=max_new_tokens, batch_size=size
            )
            seconds[path].append(time.perf_counter() - started)
            answers[path] = [item["prediction"] for item in scored]
            print(f"sweep-generate repeat {repeat + 1} {path}: {seconds[path][-1]:.1f} s", file=sys.stderr)
    engine.joined_decoding = engine.shared_prompt_starts = True
    per_hour = {path: round(len(texts) * 3600 / statistics.median(s), 1) for path, s in seconds.items()}
    joined = [path for path in paths if path.startswith("joined-") and path != "joined-1"]
    best = max(joined, key=per_hour.__getitem__)
    return {
        "sweep_generate_speedup": round(per_hour[best] / per_hour[PADDED], 2),
        "sweep_generate_speedup_vs_one_at_a_time": round(per_hour[best] / per_hour["joined-1"], 2)
        if "joined-1" in per_hour
        else None,
        "shared_starts_speedup": round(per_hour[f"joined-{max(decode_batches)}"] / per_hour[whole], 2),
        "sweep_generate": {
            "prompts": len(texts),
            "mean_prompt_tokens": round(statistics.fmean(engine.count_tokens(t) for t in texts), 1),
            "max_new_tokens": max_new_tokens,
            "prompts_per_hour": per_hour,
            "best": best,
            "answers_differing_from_padded": differing(answers, PADDED),
            # joined-1 decodes one prompt at a time: the answers every batch should give.
            "answers_differing_from_one_at_a_time": differing(answers, "joined-1")
            if "joined-1" in answers
            else None,
            "seconds": {path: [round(s, 1) for s in values] for path, values in seconds.items()},
            "load_average": [round(x, 2) for x in os.getloadavg()],
        },
    }


def differing(answers: dict[str, list[str]], reference: str) -> dict[str, int]:
    """How many answers of each other path differ from the `reference` path's."""
    return {
        path: sum(a != b for a, b in zip(given, answers[reference], strict=True))
        for path, given in answers.items()
        if path != reference
    }


if __name__ == "__main__":
    main()
