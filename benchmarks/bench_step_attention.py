"""SDPA's CPU kernel against `step_attention`: decoding steps in float32 products, prompts read
whole in bf16 blocks (`blocked_causal_attention`).

    python benchmarks/bench_step_attention.py                 # the 0.5B, 4 prompts, 32 tokens
    python benchmarks/bench_step_attention.py --model qwen2.5-coder-1.5b-instruct --prompts 2

- kernel: milliseconds per attention call of the model's head shape at `--rows` query rows over
  1,300 keys, SDPA (as transformers calls it: grouped KV heads, a mask where rows > 1) against
  `float32_attention`, in bf16; and one causal call of 1,300 rows (a prompt read whole), SDPA
  against `blocked_causal_attention`.
- read: each real prompt read whole through each attention in turn, the seconds, and how far the
  next token's distribution moved from SDPA's read (KL divergence, nats; the largest over prompts).
- decoding: real 10-document prompts (the search half, the gold fifth of ten), each read once, then
  `--new-tokens` greedy steps through each attention in turn from copies of the same cache; the
  seconds per step and whether the tokens are the same.

The model loads with `quantize="auto"` (answering's default; `--quantize none` for bf16). One
JSON line on stdout; one thread; compare within one run.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from typing import Any

import torch
import torch.nn.functional as F
from bench_cpu_inference import prompt_ids
from bench_int8_prefill import _prompts, milliseconds

from rag_mspoe.models.prompt_attention import blocked_causal_attention
from rag_mspoe.models.step_attention import NAME, float32_attention, use_step_attention

KEYS = 1300  # a 10-document prompt


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="an embedded model's name")
    parser.add_argument("--quantize", default="auto")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 11, 16])
    args = parser.parse_args()
    torch.set_num_threads(1)
    from rag_mspoe import load_model

    # step_attention with the blocks whether or not the model takes them by default (the 1.5B does not).
    model, tokenizer = load_model(args.model, threads=1, quantize=args.quantize, attn_implementation="sdpa")
    use_step_attention(model)
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    width = getattr(config, "head_dim", None) or config.hidden_size // heads
    kernel = {rows: kernel_ms(heads, kv_heads, width, rows, model.dtype) for rows in args.rows}
    kernel["prompt"] = prompt_ms(heads, kv_heads, width, model.dtype)
    _, prompts = _prompts(range(args.prompts))
    reads = [read(model, prompt_ids(tokenizer, prompt), number) for number, prompt in enumerate(prompts)]
    steps: dict[str, list[float]] = {"sdpa": [], NAME: []}
    same = 0
    for number, prompt in enumerate(prompts):
        tokens = {}
        for name in list(steps) if number % 2 == 0 else reversed(list(steps)):
            seconds, tokens[name] = decode(model, prompt_ids(tokenizer, prompt), name, args.new_tokens)
            steps[name].append(seconds)
        same += tokens["sdpa"] == tokens[NAME]
    config._attn_implementation = NAME
    sdpa, ours = (sum(steps[name]) / len(steps[name]) for name in ("sdpa", NAME))
    print(
        json.dumps(
            {
                "model": args.model,
                "dtype": str(model.dtype).removeprefix("torch."),
                "quantize": args.quantize,
                "threads": 1,
                "kernel_ms_by_rows": kernel,
                "read_seconds": {name: round(sum(r[name] for r in reads) / len(reads), 3) for name in steps},
                "read_speedup": round(sum(r["sdpa"] for r in reads) / sum(r[NAME] for r in reads), 2),
                "read_kl_max": round(max(r["kl"] for r in reads), 5),
                "read_same_next_token": f"{sum(r['same'] for r in reads)}/{len(reads)}",
                "decode_seconds_per_token": {"sdpa": round(sdpa, 4), "step_attention": round(ours, 4)},
                "decode_speedup": round(sdpa / ours, 2),
                "same_tokens": f"{same}/{len(prompts)}",
            }
        )
    )


def kernel_ms(heads: int, kv_heads: int, width: int, rows: int, dtype: torch.dtype) -> dict[str, float]:
    """One attention call of `rows` query rows over `KEYS` keys: SDPA's and the float32 products'."""
    generator = torch.Generator().manual_seed(rows)
    query = torch.randn(1, heads, rows, width, generator=generator).to(dtype)
    key, value = (torch.randn(1, kv_heads, KEYS, width, generator=generator).to(dtype) for _ in range(2))
    mask = None if rows == 1 else torch.ones(rows, KEYS, dtype=torch.bool).tril(KEYS - rows)[None, None]
    sdpa = milliseconds(
        lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True), 20
    )
    ours = milliseconds(lambda: float32_attention(query, key, value, mask, None), 20)
    return {"sdpa": round(sdpa, 3), "float32": round(ours, 3), "speedup": round(sdpa / ours, 2)}


def prompt_ms(heads: int, kv_heads: int, width: int, dtype: torch.dtype) -> dict[str, float]:
    """One causal call of `KEYS` query rows (a prompt read whole): SDPA's and the bf16 blocks'."""
    generator = torch.Generator().manual_seed(KEYS)
    query = torch.randn(1, heads, KEYS, width, generator=generator).to(dtype)
    key, value = (torch.randn(1, kv_heads, KEYS, width, generator=generator).to(dtype) for _ in range(2))
    sdpa = milliseconds(
        lambda: F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True), 5
    )
    ours = milliseconds(lambda: blocked_causal_attention(query, key, value, width**-0.5), 5)
    return {"sdpa": round(sdpa, 2), "blocks": round(ours, 2), "speedup": round(sdpa / ours, 2)}


def read(model: Any, ids: torch.Tensor, number: int) -> dict[str, Any]:
    """Seconds of one whole read of `ids` through SDPA and through ours (in turns), and the change."""
    seconds, logprobs = {}, {}
    for attention in ("sdpa", NAME) if number % 2 == 0 else (NAME, "sdpa"):
        model.config._attn_implementation = attention
        with torch.inference_mode():
            started = time.perf_counter()
            logits = model(ids, logits_to_keep=1).logits[0, -1]
            seconds[attention] = time.perf_counter() - started
        logprobs[attention] = torch.log_softmax(logits.float(), dim=-1)
    kl = float((logprobs["sdpa"].exp() * (logprobs["sdpa"] - logprobs[NAME])).sum())
    same = bool(logprobs[NAME].argmax() == logprobs["sdpa"].argmax())
    return {**seconds, "kl": kl, "same": same}


def decode(model: Any, ids: torch.Tensor, attention: str, steps: int) -> tuple[float, list[int]]:
    """Seconds per greedy step after reading `ids` (the read untimed, on SDPA), and the tokens."""
    model.config._attn_implementation = "sdpa"
    with torch.inference_mode():
        out = model(ids, logits_to_keep=1, use_cache=True)
        cache, token = copy.deepcopy(out.past_key_values), out.logits[:, -1].argmax(-1, keepdim=True)
        model.config._attn_implementation = attention
        tokens = []
        started = time.perf_counter()
        for _ in range(steps):
            out = model(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token))
        return (time.perf_counter() - started) / steps, tokens


if __name__ == "__main__":
    main()
