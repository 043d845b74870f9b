"""Position-invariant reordering's scoring with the template's rows computed once for all of a
prompt's documents (what the package does) against each document's prompt run whole, in one run on
real 10-document NQ-open prompts (gold in the middle), on the same prompts.

    python benchmarks/bench_invariant_scoring.py --model qwen2.5-coder-0.5b-instruct --prompts 30

Both paths compute the same numbers up to rounding (a forward split in two rounds otherwise in
bf16), so besides the time it prints how far the scores move and whether the ranking does: how
often the top-ranked document is the same, and how often each path ranks the gold first. One JSON
line at the end.
"""

from __future__ import annotations

import argparse
import json
import time

from search_prompts import MIDDLE, add_options, engine_and_prompts

from rag_mspoe.attention.invariant_reorder import InvariantReorder
from rag_mspoe.engine.document_prefix import DocumentPrefixCache


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_options(parser, prompts=30, threads=2)
    args = parser.parse_args()
    engine, prompts = engine_and_prompts(args)
    method = InvariantReorder()
    shared_start = DocumentPrefixCache.copy_of

    def whole(cache: DocumentPrefixCache, prefix: list[int], shared: int = 0) -> object:
        return shared_start(cache, prefix)  # the template run again with every document

    paths = {"shared template": shared_start, "whole prompts": whole}
    seconds = dict.fromkeys(paths, 0.0)
    gold_first = dict.fromkeys(paths, 0)
    same_top = 0
    moved: list[float] = []
    for index, prompt in enumerate(prompts):
        scores = {}
        # The paths alternate which goes first, so neither always meets a warmer machine.
        for name in list(paths) if index % 2 == 0 else list(paths)[::-1]:
            DocumentPrefixCache.copy_of = paths[name]  # type: ignore[method-assign]
            engine.document_prefixes.clear()  # each path pays for its own rows and scores
            started = time.perf_counter()
            scores[name] = method.scores(engine, prompt)
            seconds[name] += time.perf_counter() - started
        DocumentPrefixCache.copy_of = shared_start  # type: ignore[method-assign]
        tops = {name: max(range(len(s)), key=s.__getitem__) for name, s in scores.items()}
        same_top += len(set(tops.values())) == 1
        for name, top in tops.items():
            gold_first[name] += top == MIDDLE
        first, second = scores.values()
        moved += [abs(a - b) for a, b in zip(first, second, strict=True)]
        print(f"prompt {index + 1}/{len(prompts)}: {json.dumps(seconds)}", flush=True)
    moved.sort()
    print(
        json.dumps(
            {
                "model": args.model,
                "threads": args.threads,
                "prompts": len(prompts),
                "seconds": {name: round(s, 1) for name, s in seconds.items()},
                "speed_up": round(seconds["whole prompts"] / seconds["shared template"], 2),
                "same_top_document": same_top,
                "gold_ranked_first": gold_first,
                "score_change_nats": {"median": round(moved[len(moved) // 2], 3), "max": round(moved[-1], 3)},
            }
        )
    )


if __name__ == "__main__":
    main()
