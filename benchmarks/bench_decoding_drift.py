"""The decoding schemes' drift: the gold answer's log-likelihood per token, unquantised against
`--quantize int8-decoding` or `int4-decoding`, on real 10-document prompts.

    python benchmarks/bench_decoding_drift.py --scheme int8-decoding --prompts 100 --first-prompt 20
    python benchmarks/bench_decoding_drift.py --model qwen2.5-coder-1.5b-instruct --scheme int4-decoding

Those schemes read a prompt on the model's own weights and change only the calls of 16 tokens or
fewer (decoding, a scored answer). So each prompt is read once, on the unquantised layers, and the
answer is scored twice from copies of that read: on the decoding codes and on the model's own
weights (every wrapped layer pointed back at its original for the reference). The result equals
two separate models' scores and costs one prompt read instead of two. The model loads in the
dtype this CPU computes best (float32 without native bf16, where these schemes are meant to run;
`--dtype` to choose). Prompts are the search half's (gold in the middle, as bench_int8_prefill's
drift); from prompt 20 on, none that chose a scheme was read. Progress on stderr; one JSON line
(per-prompt values included) on stdout, written to `--out` after every prompt, so a run stopped
part way resumes from there.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench_int8_prefill import _prompts

SCHEMES = ("int8-decoding", "int4-decoding")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="an embedded model's name")
    parser.add_argument("--scheme", choices=SCHEMES, default="int8-decoding")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--first-prompt", type=int, default=20)
    parser.add_argument("--dtype", default="auto", help="the model's dtype (auto: this CPU's best)")
    parser.add_argument("--out", type=Path, help="the JSON record, rewritten after every prompt (resumes)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from rag_mspoe import load_model
    from rag_mspoe.engine import Engine
    from rag_mspoe.models.embedded_models import prepare
    from rag_mspoe.models.quantization import quantization_census, quantize_model

    model, tokenizer = load_model(args.model, dtype=args.dtype, threads=1, quantize="none")
    quantize_model(model, args.scheme, prepare(args.model))
    engine = Engine(model, tokenizer, method="none")
    record = _resumed(args.out) or {
        "model": args.model,
        "scheme": args.scheme,
        "dtype": str(model.dtype).removeprefix("torch."),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": 1,
        "first_prompt": args.first_prompt,
        "census": quantization_census(model),
        "loglik_per_token": {"reference": [], args.scheme: []},
        "answer_tokens": [],
    }
    done = len(record["answer_tokens"])
    numbers = range(args.first_prompt + done, args.first_prompt + args.prompts)
    examples, prompts = _prompts(numbers) if len(numbers) else ([], [])
    for number, (example, prompt) in enumerate(zip(examples, prompts, strict=True), start=done + 1):
        started = time.perf_counter()
        scores = _scored_both_ways(engine, prompt, example.answers[0])
        for name, (total, tokens) in zip(("reference", args.scheme), scores, strict=True):
            record["loglik_per_token"][name].append(round(total / tokens, 5))
        record["answer_tokens"].append(scores[0][1])
        record.update(_summary(record, args.scheme))
        if args.out:
            args.out.write_text(json.dumps(record) + "\n")
        print(
            f"drift, prompt {number}/{args.prompts}: {record['abs_loglik_diff_per_token'][-1]:.4f} "
            f"({time.perf_counter() - started:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
    print(json.dumps(record), flush=True)


def _scored_both_ways(engine: Any, prompt: Any, answer: str) -> list[tuple[float, int]]:
    """(log-likelihood, tokens) of `answer` after `prompt`, on the model's own weights, then on the
    decoding codes, from one read of the prompt."""
    from rag_mspoe.engine.prefix_scoring import score_after_prefill
    from rag_mspoe.rope.hooks import returned_cache

    model = engine.model
    request = engine._continuations(prompt, [answer], False, "", None)
    ids = torch.tensor([request.prefill])
    with torch.inference_mode():
        read = model.model(ids, use_cache=True)  # the prompt: every layer on its own weights
        last = read.last_hidden_state[:, -1:]
        scores = []
        for on_codes in (False, True):
            with _decoding(model, on_codes):
                logits = model.lm_head(last)
                cache = copy.deepcopy(returned_cache(read))
                scores += score_after_prefill(model, request, cache, logits, engine._pad_id)
    return scores


class _decoding:
    """Short calls on the decoding codes (True) or on each wrapped layer's own weights (False)."""

    def __init__(self, model: Any, on_codes: bool) -> None:
        from rag_mspoe.models.grid_decoding import GridDecodingLinear

        self.layers = [m for m in model.modules() if isinstance(m, GridDecodingLinear)]
        self.on_codes = on_codes

    def __enter__(self) -> None:
        self.saved = [layer.decoding for layer in self.layers]
        if not self.on_codes:
            for layer in self.layers:
                layer.decoding = layer.prompt_layer

    def __exit__(self, *_: object) -> None:
        for layer, decoding in zip(self.layers, self.saved, strict=True):
            layer.decoding = decoding


def _summary(record: dict[str, Any], scheme: str) -> dict[str, Any]:
    scores = record["loglik_per_token"]
    moved = [abs(a - b) for a, b in zip(scores[scheme], scores["reference"], strict=True)]
    return {
        "prompts": len(moved),
        "mean_abs_loglik_diff_per_token": round(statistics.fmean(moved), 4),
        "median_abs_loglik_diff_per_token": round(statistics.median(moved), 4),
        "max_abs_loglik_diff_per_token": round(max(moved), 4),
        "abs_loglik_diff_per_token": [round(value, 4) for value in moved],
    }


def _resumed(path: Path | None) -> dict[str, Any] | None:
    if path is None or not path.exists():
        return None
    record: dict[str, Any] = json.loads(path.read_text())
    return record


if __name__ == "__main__":
    main()
