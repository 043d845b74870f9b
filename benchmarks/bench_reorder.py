"""Cost of calibrated and position-invariant reordering against the unmodified model: a greedy
answer through the engine on real NQ-open prompts, the methods alternating prompt by prompt in
one run.

    python benchmarks/bench_reorder.py --model qwen2.5-coder-0.5b-instruct --prompts 4

The ranking pass reads only the question rows on the unmodified model's cache of the documents,
but that cache is one prefill of the prompt as given; the answer is then prefilled from the
reordered prompt. So the expected cost is about two prefills and the same decoding. Invariant
reordering runs one short pass per document (template, document, question): about one prefill of
the whole prompt in all, then the answer's; reading only the top-ranked document
(`invariant-reorder:1`) makes that answer's prefill one document long. Prints seconds per answer
for each method and its ratio to the unmodified model's, as one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import time

from search_prompts import add_options, engine_and_prompts

METHODS = ("none", "calibrated-reorder", "invariant-reorder", "invariant-reorder:1")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_options(parser, prompts=4, threads=1)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    engine, prompts = engine_and_prompts(args)
    engine.generate(prompts[0], method="calibrated-reorder", max_new_tokens=2)  # bias estimate, warm-up
    seconds = dict.fromkeys(METHODS, 0.0)
    for index, prompt in enumerate(prompts):
        for method in METHODS:
            engine.document_prefixes.clear()  # every answer pays for its own prefixes
            started = time.perf_counter()
            engine.generate(prompt, method=method, max_new_tokens=args.new_tokens, stop=["\n"])
            seconds[method] += time.perf_counter() - started
        print(f"prompt {index + 1}/{len(prompts)}: {json.dumps(seconds)}", flush=True)
    result = {
        "model": args.model,
        "threads": args.threads,
        "prompts": len(prompts),
        "seconds_per_answer": {m: round(s / len(prompts), 2) for m, s in seconds.items()},
        "ratio_to_none": {m: round(seconds[m] / seconds["none"], 2) for m in METHODS[1:]},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
