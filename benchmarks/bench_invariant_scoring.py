"""Position-invariant reordering's scoring read as one tree of every document's prompts (what the
package does, `rag_mspoe.attention.token_tree`) against each prompt read alone after the template's
kept rows (what it did before), in one run on real NQ-open prompts (gold in the middle), on the
default answering path (`Engine.load`'s quantisation).

    python benchmarks/bench_invariant_scoring.py --model qwen2.5-coder-1.5b-instruct --prompts 6
    python benchmarks/bench_invariant_scoring.py --model qwen2.5-coder-0.5b-instruct --prompts 8 --float32
    python benchmarks/bench_invariant_scoring.py --model qwen2.5-coder-1.5b-instruct --prompts 10 \
        --data docs/results/nq20-1.5b/validation-20.jsonl.gz --gold 9

Both paths compute the same numbers up to rounding (the rows are read in other groupings in bf16
or int8), so besides the time it prints how far the scores move and whether the ranking does: how
often the top-ranked document is the same, and how often each path ranks the gold first. With
`--float32` it also scores each prompt on the model in float32 (read alone): how far each path's
scores are from those, and how often its top-ranked document is float32's. One JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import time
import unittest.mock
from typing import Any

from search_prompts import MIDDLE, add_options, search_prompts

from rag_mspoe.attention import invariant_reorder
from rag_mspoe.attention.invariant_reorder import SCORES, InvariantReorder
from rag_mspoe.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_options(parser, prompts=6, threads=1)
    parser.add_argument("--score", choices=[s for s in SCORES if s != "attention"], default="question+judge")
    parser.add_argument("--float32", action="store_true", help="also score on the model in float32")
    parser.add_argument("--gold", type=int, default=MIDDLE, help="the gold document's place (from 0)")
    args = parser.parse_args()
    engine = Engine.load(args.model, threads=args.threads)
    exact = {"dtype": "float32", "quantize": "none"}
    reference = Engine.load(args.model, threads=args.threads, **exact) if args.float32 else None
    prompts = search_prompts(args.data, args.prompts, args.gold)
    method = InvariantReorder(score=args.score)
    paths = {"tree": False, "one by one": True}
    seconds = dict.fromkeys(paths, 0.0)
    gold_first = dict.fromkeys(paths, 0)
    same_as_float32 = dict.fromkeys(paths, 0)
    from_float32: dict[str, list[float]] = {name: [] for name in paths}
    same_top = 0
    moved: list[float] = []
    for index, prompt in enumerate(prompts):
        scores = {}
        # The paths alternate which goes first, so neither always meets a warmer machine.
        for name in list(paths) if index % 2 == 0 else list(paths)[::-1]:
            engine.document_prefixes.clear()  # each path pays for its own rows and scores
            started = time.perf_counter()
            scores[name] = _scores(method, engine, prompt, alone=paths[name])
            seconds[name] += time.perf_counter() - started
        tops = {name: _top(s) for name, s in scores.items()}
        same_top += len(set(tops.values())) == 1
        for name, top in tops.items():
            gold_first[name] += top == args.gold
        first, second = scores.values()
        moved += [abs(a - b) for a, b in zip(first, second, strict=True)]
        if reference is not None:
            float32 = _scores(method, reference, prompt, alone=True)
            for name, got in scores.items():
                same_as_float32[name] += tops[name] == _top(float32)
                from_float32[name] += [abs(a - b) for a, b in zip(got, float32, strict=True)]
        print(f"prompt {index + 1}/{len(prompts)}: {json.dumps(seconds)}", flush=True)
    moved.sort()
    result: dict[str, Any] = {
        "model": args.model,
        "score": args.score,
        "threads": args.threads,
        "prompts": len(prompts),
        "documents": len(invariant_reorder.document_texts(prompts[0])),
        "gold": args.gold,
        "seconds_per_prompt": {name: round(s / len(prompts), 2) for name, s in seconds.items()},
        "speed_up": round(seconds["one by one"] / seconds["tree"], 2),
        "same_top_document": same_top,
        "gold_ranked_first": gold_first,
        "score_change": {"median": round(moved[len(moved) // 2], 3), "max": round(moved[-1], 3)},
    }
    if args.float32:
        result["top_same_as_float32"] = same_as_float32
        result["mean_change_from_float32"] = {
            name: round(sum(values) / len(values), 3) for name, values in from_float32.items()
        }
    print(json.dumps(result))


def _scores(method: InvariantReorder, engine: Engine, prompt: Any, *, alone: bool) -> list[float]:
    """The method's scores of `prompt`'s documents; `alone`: each prompt read by itself, as a model
    whose cache cannot hold a tree reads them."""
    if not alone:
        return method.scores(engine, prompt)
    with unittest.mock.patch.object(invariant_reorder, "cache_grows_plainly", lambda model: False):
        return method.scores(engine, prompt)


def _top(scores: list[float]) -> int:
    return max(range(len(scores)), key=scores.__getitem__)


if __name__ == "__main__":
    main()
