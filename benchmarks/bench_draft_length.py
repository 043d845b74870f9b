"""Seconds per RAG answer by prompt-lookup draft length, on one model and quantisation.

    python benchmarks/bench_draft_length.py --model qwen2.5-coder-1.5b-instruct --quantize int8-prompt+int4

A drafted step checks the drafted tokens and one more in one call. On bf16 weights such a check
costs about what one token costs (decoding is bound by reading the weights); through the int4
kernel its time grows with the tokens (`rag_mspoe.models.grid_decoding`), so the draft length
that pays differs. Real 10-document prompts (the search half's first `--prompts`, the gold fifth
and first), greedy answers of `--new-tokens`, each draft length in turn per prompt (the order
reversed every other prompt), from a cold engine, one thread. One JSON line per prompt on stdout
(seconds and answer text per length), then the totals; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from bench_answer import GOLD_SLOTS
from bench_cpu_inference import DATA


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="an embedded model's name")
    parser.add_argument("--quantize", default="auto", help="the scheme to load (default: answering's)")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--lengths", type=int, nargs="+", default=[10, 4, 0], help="draft lengths (0: none)")
    args = parser.parse_args()
    import torch

    from rag_mspoe.engine import Engine
    from rag_mspoe.eval.data.loaders import load_qa
    from rag_mspoe.eval.data.prompts import qa_prompt
    from rag_mspoe.eval.data.records import with_gold_at
    from rag_mspoe.models.quantization import quantization_of

    torch.set_num_threads(1)
    started = time.perf_counter()
    engine = Engine.load(args.model, threads=1, quantize=args.quantize)
    scheme = quantization_of(engine.model)
    print(
        json.dumps(
            {
                "model": args.model,
                "quantization": scheme,
                "load_seconds": round(time.perf_counter() - started, 1),
            }
        )
    )
    totals = dict.fromkeys(args.lengths, 0.0)
    examples = load_qa(DATA)[: args.prompts]
    for gold, at in GOLD_SLOTS.items():
        for number, example in enumerate(examples):
            prompt = qa_prompt(with_gold_at(example, at))
            row: dict[str, object] = {"gold": gold, "prompt": number}
            for length in args.lengths if number % 2 == 0 else reversed(args.lengths):
                engine.prompt_lookup_tokens = length
                engine.document_prefixes.clear()  # a cold start
                begun = time.perf_counter()
                text = engine.generate(prompt, max_new_tokens=args.new_tokens).text
                seconds = time.perf_counter() - begun
                totals[length] += seconds
                row[f"seconds_{length}"], row[f"text_{length}"] = round(seconds, 2), text
                print(f"gold {gold}, prompt {number + 1}, draft {length}: {seconds:.1f} s", file=sys.stderr)
            print(json.dumps(row), flush=True)
    fewest = min(totals.values())
    print(
        json.dumps(
            {
                "total_seconds": {k: round(v, 1) for k, v in totals.items()},
                "vs_quickest": {k: round(v / fewest, 2) for k, v in totals.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
