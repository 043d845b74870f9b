"""CPU inference of one model: int8 against bf16 and fp32, 1 against 2 threads, eager against compiled decode.

    python benchmarks/bench_cpu_inference.py --parts dtypes threads decode --prompts 4
    python benchmarks/bench_cpu_inference.py --model qwen2.5-coder-1.5b-instruct --parts decode --prompts 2

Prompts are real 10-document QA prompts from the sweep's prompt builder (NQ-open questions of
docs/results/nq10-split/search-10.jsonl.gz, gold document at position 4). Each part measures its
paths side by side in one process, alternating prompt by prompt, so a change in the machine's
load hits every path alike; compare within a part, not across runs.

- dtypes: prefill tokens/s (one prompt forward, logits at the last position) and decode tokens/s
  (`--new-tokens` greedy steps on its KV cache) in fp32, bf16 and int8 (`quantize="int8"` on
  the bf16 model), and
  how far each moves the gold answer's log-likelihood per token from fp32 (int8 from bf16 too).
  `--torchao` adds torchao's Int8DynamicActivationInt8Weight on the fp32 model, where installed.
- threads: prefill and decode tokens/s of the default dtype on 1 and 2 threads.
- decode: decode tokens/s of `Engine.generate` in the default dtype, eager against the compiled
  static-cache path (`Engine(compile=True)`), after the compiled path's first call on each
  prompt (which compiles for that prompt's length; its seconds are reported apart); decode time
  is a call of `--new-tokens` tokens less a call of one.

One JSON line per part on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "docs" / "results" / "nq10-split" / "search-10.jsonl.gz"
GOLD_POSITION = 4


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--parts", nargs="+", choices=["dtypes", "threads", "decode"], default=["dtypes"])
    parser.add_argument("--prompts", type=int, default=4, help="real prompts per part")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps per prompt")
    parser.add_argument("--threads", type=int, default=None, help="for dtypes and decode (default: all CPUs)")
    parser.add_argument("--torchao", action="store_true", help="dtypes: add torchao's int8 too")
    args = parser.parse_args()

    import torch

    from rag_mspoe import load_model
    from rag_mspoe.eval.data.loaders import load_qa
    from rag_mspoe.eval.data.prompts import qa_prompt
    from rag_mspoe.eval.data.records import with_gold_at

    threads = args.threads or len(os.sched_getaffinity(0))
    examples = load_qa(DATA)[: args.prompts]
    items = [(qa_prompt(with_gold_at(example, GOLD_POSITION)), example.answers[0]) for example in examples]
    model, tokenizer = load_model(args.model, dtype="float32", threads=threads)
    common = {"model": args.model, "prompts": len(items), "new_tokens": args.new_tokens}
    for part in args.parts:
        torch.set_num_threads(threads)
        started = time.perf_counter()
        if part == "dtypes":
            result = dtypes(model, tokenizer, items, args.new_tokens, args.torchao)
        elif part == "threads":
            result = thread_counts(model, tokenizer, items, args.new_tokens)
        else:
            result = decoding(model, tokenizer, items, args.new_tokens)
        result.update(
            common,
            part=part,
            seconds=round(time.perf_counter() - started, 1),
            load_average=[round(x, 2) for x in os.getloadavg()],
        )
        print(json.dumps(result), flush=True)


def progress(part: str, number: int, count: int, name: str, seconds: tuple[float, float]) -> None:
    prefill, decode = seconds
    print(
        f"{part} prompt {number + 1}/{count} {name}: prefill {prefill:.1f} s, decode {decode:.1f} s",
        file=sys.stderr,
        flush=True,
    )


def prompt_ids(tokenizer: Any, prompt: str) -> Any:
    import torch

    from rag_mspoe.prompts.chat_template import render

    return torch.tensor([render(tokenizer, prompt)])


def prefill_and_decode(model: Any, ids: Any, steps: int) -> tuple[float, float]:
    """Seconds of one prompt forward (logits at its last position) and of `steps` greedy steps after it."""
    import torch

    from rag_mspoe.rope.hooks import cache_argument, returned_cache

    with torch.inference_mode():
        started = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1)
        prefilled = time.perf_counter()
        cache, token = returned_cache(out), out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            out = model(token, **cache_argument(cache), use_cache=True)
            cache, token = returned_cache(out), out.logits[:, -1:].argmax(-1)
        return prefilled - started, time.perf_counter() - prefilled


def rates(seconds: dict[str, list[tuple[float, float]]], tokens: int, steps: int) -> dict[str, Any]:
    """Prefill and decode tokens/s of each path over all prompts."""
    return {
        name: {
            "prefill_tokens_per_s": round(tokens / sum(p for p, _ in runs), 1),
            "decode_tokens_per_s": round(steps * len(runs) / sum(d for _, d in runs), 2),
        }
        for name, runs in seconds.items()
    }


def dtypes(
    model: Any, tokenizer: Any, items: list[tuple[str, str]], steps: int, torchao: bool
) -> dict[str, Any]:
    import torch

    from rag_mspoe.engine import Engine
    from rag_mspoe.models.quantization import quantize_model

    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    # int8 as load_model(quantize="int8") gives it: weight-only, embeddings and norms in bf16.
    int8 = quantize_model(copy.deepcopy(bf16), "int8")
    variants: dict[str, Any] = {"fp32": model, "bf16": bf16, "int8": int8}
    if torchao:
        variants["torchao-int8"] = torchao_int8(copy.deepcopy(model))
    seconds: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    gold: dict[str, list[float]] = {name: [] for name in variants}
    tokens = 0
    for number, (prompt, answer) in enumerate(items):
        ids = prompt_ids(tokenizer, prompt)
        tokens += ids.shape[1]
        names = list(variants) if number % 2 == 0 else list(reversed(variants))
        for name in names:
            seconds[name].append(prefill_and_decode(variants[name], ids, steps))
            progress("dtypes", number, len(items), name, seconds[name][-1])
            engine = Engine(variants[name], tokenizer, method="none")
            total, count = engine.score_continuations(prompt, [answer])[0]
            gold[name].append(total / count)

    def moved(name: str, reference: str) -> dict[str, float]:
        diffs = [abs(a - b) for a, b in zip(gold[name], gold[reference], strict=True)]
        return {"mean": round(statistics.fmean(diffs), 4), "max": round(max(diffs), 4)}

    result = rates(seconds, tokens, steps)
    return {
        "mean_prompt_tokens": round(tokens / len(items), 1),
        "rates": result,
        "int8_over_bf16": ratios(result["int8"], result["bf16"]),
        "gold_loglik_per_token_moved_vs_fp32": {
            name: moved(name, "fp32") for name in variants if name != "fp32"
        },
        "int8_gold_loglik_per_token_moved_vs_bf16": moved("int8", "bf16"),
    }


def ratios(path: dict[str, float], reference: dict[str, float]) -> dict[str, float]:
    """Each rate of `path` over the same rate of `reference`."""
    return {key: round(path[key] / reference[key], 3) for key in path}


def torchao_int8(model: Any) -> Any:
    """The model with torchao's dynamic int8 activations (one scale per token) and int8 weights,
    in the attention projections and the MLP's gate and up projections (as the earlier dynamic int8 did)."""
    from torch import nn
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    def ours(module: Any, name: str) -> bool:
        return isinstance(module, nn.Linear) and name.rpartition(".")[2] not in ("lm_head", "down_proj")

    quantize_(model, Int8DynamicActivationInt8WeightConfig(), filter_fn=ours)
    return model


def thread_counts(model: Any, tokenizer: Any, items: list[tuple[str, str]], steps: int) -> dict[str, Any]:
    import torch

    from rag_mspoe.models.devices import default_dtype

    dtype = default_dtype("cpu")
    local = copy.deepcopy(model).to(dtype)
    seconds: dict[str, list[tuple[float, float]]] = {"1": [], "2": []}
    tokens = 0
    for number, (prompt, _) in enumerate(items):
        ids = prompt_ids(tokenizer, prompt)
        tokens += ids.shape[1]
        for count in ("1", "2") if number % 2 == 0 else ("2", "1"):
            torch.set_num_threads(int(count))
            seconds[count].append(prefill_and_decode(local, ids, steps))
            progress("threads", number, len(items), count, seconds[count][-1])
    result = rates(seconds, tokens, steps)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "rates": result,
        "2_over_1": ratios(result["2"], result["1"]),
    }


def decoding(model: Any, tokenizer: Any, items: list[tuple[str, str]], steps: int) -> dict[str, Any]:
    from rag_mspoe.engine import Engine
    from rag_mspoe.models.devices import default_dtype

    dtype = default_dtype("cpu")
    local = copy.deepcopy(model).to(dtype)
    engines = {"eager": Engine(local, tokenizer, method="none", compile=False)}
    engines["compiled"] = Engine(local, tokenizer, method="none", compile=True)
    seconds: dict[str, float] = {"eager": 0.0, "compiled": 0.0}
    generated: dict[str, int] = {"eager": 0, "compiled": 0}
    first_calls = []
    for number, (prompt, _) in enumerate(items):
        # The static cache is sized to the prompt plus the new tokens, so each prompt length
        # compiles (or recompiles) the decode step: that first call is timed apart.
        first_calls.append(round(generation(engines["compiled"], prompt, steps)[0], 1))
        print(
            f"decode prompt {number + 1}: first compiled call {first_calls[-1]} s",
            file=sys.stderr,
            flush=True,
        )
        for name in ("eager", "compiled") if number % 2 == 0 else ("compiled", "eager"):
            first, _ = generation(engines[name], prompt, 1)
            whole, tokens = generation(engines[name], prompt, steps)
            seconds[name] += whole - first
            generated[name] += tokens - 1
            progress("decode", number, len(items), name, (first, whole - first))
    tokens_per_s = {name: round(generated[name] / seconds[name], 2) for name in seconds}
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "decode_tokens_per_s": tokens_per_s,
        "compiled_over_eager": round(tokens_per_s["compiled"] / tokens_per_s["eager"], 3),
        "first_compiled_call_seconds": first_calls,
    }


def generation(engine: Any, prompt: str, tokens: int) -> tuple[float, int]:
    """Seconds of one greedy generation of at most `tokens` tokens (the prompt as plain text,
    which the model goes on writing), and the tokens it generated."""
    started = time.perf_counter()
    result = engine.generate(prompt, raw=True, max_new_tokens=tokens)
    return time.perf_counter() - started, result.completion_tokens


if __name__ == "__main__":
    main()
