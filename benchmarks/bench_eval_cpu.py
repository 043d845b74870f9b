"""Prompts per hour of a gold-position sweep's scoring on the CPU: the plain path against shared starts.

    python benchmarks/bench_eval_cpu.py --quick --oracle nq-open-oracle.jsonl.gz
    python benchmarks/bench_eval_cpu.py --model qwen2.5-coder-1.5b-instruct --documents 20 --samples 4 \\
        --oracle nq-open-oracle.jsonl.gz

Both paths score the same (method, gold position, example) items with forced choice and the
gold answer's log-likelihood (`--metrics loglik choice` of a sweep), in one process on one model:
- plain: one `Engine.score_continuations` per prompt (a full prompt forward, logits at its last
  position, the candidates in one batch over its cache), as sweeps scored before;
- shared: the sweep's `BatchScorer` on batches of whole examples, where prompts computed under
  methods that allow it share their common start (`rag_mspoe.engine.prefix_scoring`).
The two alternate example by example, so a change in the machine's load hits both alike.

Examples come from an oracle file of the lost-in-the-middle format (question, answers, one gold
passage): each gets `--documents - 1` distractors, the gold passages of other records that hold
none of its answers, and as candidates its gold answer and those records' answers. Without
--oracle the invented-fact generator is used (shorter prompts).

Progress goes to stderr, one line per (example, path, method) with its seconds, so a slow run
shows where it is. The JSON line printed last holds `speedup` (shared over plain prompts per hour),
`max_abs_loglik_diff` (largest difference of a gold log-likelihood between the paths, nats per
token), and the achieved GFLOP/s of each path against the machine's bf16 and fp32 matmul peak
measured here with a large matmul. On a machine other jobs share, absolute rates are depressed;
the ratio is what the run measures.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Sized to finish in minutes on 2 CPUs: 2 examples x 4 methods x 3 positions, on each path.
QUICK = {"model": "qwen2.5-coder-0.5b-instruct", "documents": 10, "samples": 2}
METHODS = "none,pi,layerwise,static-mspoe"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="0.5B, 10 documents, 2 examples")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument(
        "--oracle", default=None, help="oracle QA file (.jsonl or .jsonl.gz); else invented facts"
    )
    parser.add_argument("--documents", type=int, default=10)
    parser.add_argument("--samples", type=int, default=4, help="examples")
    parser.add_argument("--positions", default="0,4,9")
    parser.add_argument("--methods", default=METHODS, help="'static-mspoe' is Ms-PoE with a fixed head order")
    parser.add_argument("--dtype", default=None, help="as load_model takes it (default: bf16 where native)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quantize", choices=["int8"], default=None, help="as load_model takes it")
    args = parser.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key.replace("-", "_"), value)

    import torch

    from rag_mspoe import load_model

    peak = {name: matmul_gflops(dtype) for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))}
    model, tokenizer = load_model(args.model, dtype=args.dtype, threads=args.threads, quantize=args.quantize)
    result = compare_paths(model, tokenizer, args)
    dtype = str(model.dtype).replace("torch.", "")
    result.update(
        model=args.model,
        dtype=dtype,
        quantize=args.quantize,
        threads=torch.get_num_threads(),
        matmul_peak_gflops=peak,
        load_average=os.getloadavg()[0],
    )
    own_peak = peak["bf16" if model.dtype == torch.bfloat16 else "fp32"]
    for path in ("plain", "shared"):
        result[f"{path}_share_of_peak"] = round(result[f"{path}_gflops"] / own_peak, 3)
    print(json.dumps(result))


def compare_paths(model: Any, tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    from rag_mspoe.engine import Engine
    from rag_mspoe.eval.method_engines import EngineSet
    from rag_mspoe.eval.sweep.batch_scorer import BatchScorer, arranged_example, candidates_of, prompt_of
    from rag_mspoe.eval.sweep.plan import Batch, SweepConfig, load_examples
    from rag_mspoe.methods.method_spec import resolve_all

    positions = tuple(int(p) for p in args.positions.split(","))
    with tempfile.TemporaryDirectory(prefix="bench-eval-cpu-") as scratch:
        specs = [
            static_mspoe_spec(model, Path(scratch)) if m == "static-mspoe" else m
            for m in args.methods.split(",")
        ]
        data = (
            write_examples(args.oracle, args.documents, args.samples, Path(scratch)) if args.oracle else None
        )
        config = SweepConfig(
            num_documents=args.documents,
            positions=positions,
            methods=tuple(specs),
            samples=args.samples,
            data=data,
            generator=None if data else "invented-qa",
            metrics=("loglik", "choice"),
            batch_size=len(positions),
        )
        examples = load_examples(config)
        methods = resolve_all(config.methods)
    engines = EngineSet(model, tokenizer)
    scorer = BatchScorer(config, examples, methods, engines)
    engine: Engine = engines.engine_for(methods[0])
    seconds = {"plain": 0.0, "shared": 0.0}
    gold = {"plain": {}, "shared": {}}
    tokens = 0
    flops = 0.0
    for index in range(len(examples)):
        runs = ["plain", "shared"] if index % 2 == 0 else ["shared", "plain"]
        for path in runs:
            for method in methods:
                started = time.perf_counter()
                if path == "shared":
                    for record in scorer.score(Batch(method.name, tuple((p, index) for p in positions))):
                        key = (method.name, record["position"], index)
                        gold[path][key] = (record["gold_logprob"], record["gold_tokens"])
                else:
                    for position in positions:
                        example, _ = arranged_example(method, examples[index], position, config.seed)
                        options, answer = candidates_of(example)
                        prompt = prompt_of(example)
                        scored = engine.score_continuations(prompt, list(options), method=method.method)
                        gold[path][(method.name, position, index)] = scored[list(options).index(answer)]
                        length = engine.count_tokens(prompt)
                        tokens += length
                        flops += prefill_flops(model.config, length)
                took = time.perf_counter() - started
                seconds[path] += took
                print(
                    f"example {index + 1}/{len(examples)} {path} {method.name}: {took:.1f} s", file=sys.stderr
                )
    prompts = len(gold["plain"])
    diffs = [
        abs(gold["plain"][key][0] - gold["shared"][key][0]) / gold["plain"][key][1] for key in gold["plain"]
    ]
    hour = 3600.0
    return {
        "prompts": prompts,
        "mean_prompt_tokens": round(tokens / prompts, 1),
        "plain_prompts_per_hour": round(prompts / seconds["plain"] * hour, 1),
        "shared_prompts_per_hour": round(prompts / seconds["shared"] * hour, 1),
        "speedup": round(seconds["plain"] / seconds["shared"], 3),
        "max_abs_loglik_diff": max(diffs),
        # The plain path's model FLOPs over each path's time: the shared path's figure is the
        # rate at which it gets the same answers, not what the CPU executes.
        "plain_gflops": round(flops / seconds["plain"] / 1e9, 1),
        "shared_gflops": round(flops / seconds["shared"] / 1e9, 1),
    }


def prefill_flops(config: Any, length: int) -> float:
    """Multiply-adds x 2 of one prompt forward: the layers' weights per token, causal attention
    (scores and weighted values), and the output layer at the last position only."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    per_layer = hidden * heads * head_dim * 2 + hidden * kv * 2 + 3 * hidden * config.intermediate_size
    layers = config.num_hidden_layers
    attention = 2 * layers * heads * head_dim * length * (length + 1)  # QK^T and AV, causal halves
    return 2.0 * layers * per_layer * length + attention + 2.0 * hidden * config.vocab_size


def matmul_gflops(dtype: Any, size: int = 2048, repeats: int = 5) -> float:
    """Best GFLOP/s of a large square matmul in `dtype`: the machine's practical peak."""
    import torch

    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return round(2 * size**3 / best / 1e9, 1)


def static_mspoe_spec(model: Any, folder: Path) -> str:
    """'static-mspoe=<config>': Ms-PoE with a fixed head order (its cost does not depend on which)."""
    from rag_mspoe.methods import MsPoE

    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    method = MsPoE(head_order=[list(range(heads))] * config.num_hidden_layers)
    return f"static-mspoe={method.save(folder / 'static-mspoe.json')}"


def write_examples(oracle: str, documents: int, samples: int, folder: Path) -> str:
    """QA examples with candidates from an oracle file (see the module docstring)."""
    opener = gzip.open if oracle.endswith(".gz") else open
    with opener(oracle, "rt") as lines:
        records = [json.loads(line) for line in lines if line.strip()]
    rng = random.Random(0)
    rows = []
    for number, record in enumerate(records[:samples]):
        gold = dict(record["ctxs"][0], isgold=True)
        answers = [answer.lower() for answer in record["answers"]]
        distractors, candidates = [], [record["answers"][0]]
        for other in rng.sample(range(len(records)), len(records)):
            passage, answer = records[other]["ctxs"][0], records[other]["answers"][0]
            if other == number or answer in candidates or any(a in passage["text"].lower() for a in answers):
                continue
            distractors.append({"title": passage["title"], "text": passage["text"], "isgold": False})
            candidates.append(answer)
            if len(distractors) == documents - 1:
                break
        rows.append(
            {
                "id": f"q{number}",
                "question": record["question"],
                "answers": record["answers"],
                "ctxs": [gold, *distractors],
                "candidates": sorted(candidates),
            }
        )
    path = folder / "examples.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


if __name__ == "__main__":
    main()
