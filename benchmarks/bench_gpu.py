"""Cost of each method on a GPU, on random weights of real model shapes, as ratios against the
unmodified model on the same path in the same run.

    python benchmarks/bench_gpu.py                                 # Llama-3-8B and Qwen2.5-7B shapes
    python benchmarks/bench_gpu.py --shapes llama3-8b --lengths 4096 --batches 1 --paths compiled
    python benchmarks/bench_gpu.py --smoke                         # a tiny shape on the CPU

Weights are random (no download) in bf16, SDPA attention. Per shape, prompt length and batch
size it prints, for every method: prefill seconds, decode tokens/s (per sequence) and peak GPU
memory, each with its ratio to the unmodified model, on two paths:
  eager     a dynamic KV cache and the plain forward (the engine's CPU path);
  compiled  a static KV cache, eager prefill, and a decode step compiled with
            torch.compile(fullgraph=True, mode="reduce-overhead") (the engine's CUDA path).
It also times the Ms-PoE statistic done the reference's way (a full T x T fp32 attention matrix
per layer) against ours (the last prompt row only). A cell that runs out of memory says OOM.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import transformers
from transformers import DynamicCache, StaticCache

from rag_mspoe import Compose, HiddenScale, LayerWise, MsPoE, Uniform, rescaled
from rag_mspoe.rope.awareness import position_awareness
from rag_mspoe.rope.hooks import cache_argument

SHAPES: dict[str, Callable[[], Any]] = {
    "llama3-8b": lambda: transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
    ),
    "qwen2.5-7b": lambda: transformers.Qwen2Config(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6,
    ),
    "tiny": lambda: transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    ),
}


def methods_for(config: Any) -> dict[str, Any]:
    """Every kind of method, sized for the model (static Ms-PoE needs one head order per layer)."""
    layers, kv = config.num_hidden_layers, config.num_key_value_heads
    return {
        "none": None,
        "uniform": Uniform(1.5),
        "layerwise": LayerWise(
            control_points=[(0.0, 1.0), (0.33, 1.8), (0.67, 1.6), (1.0, 1.2)], x_is_fraction=True
        ),
        "layerwise+pi": Compose(
            [LayerWise(factors=[1.0] * (layers // 2) + [1.3] * (layers - layers // 2)), Uniform(1.2)]
        ),
        "mspoe-static": MsPoE(head_order=[list(range(kv))] * layers),
        "mspoe": MsPoE(),
        "mspoe-query-head": MsPoE(gqa_policy="query_head"),
        "hidden": HiddenScale(dimension=config.hidden_size // 3, factor=0.0),
    }


class Clock:
    """Wall time of GPU work: synchronises before reading the time."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def run_once(
    model: Any, ids: torch.Tensor, path: str, decode_tokens: int, warmup: int, backend: str
) -> tuple[float, float, int]:
    """(prefill seconds, decode tokens/s per sequence, peak bytes) of one prompt batch."""
    device, (batch, length) = ids.device, ids.shape
    clock = Clock(device)
    static = path == "compiled"
    total = length + warmup + decode_tokens
    cache: Any = (
        StaticCache(config=model.config, max_cache_len=total) if static else DynamicCache(config=model.config)
    )
    mask = torch.ones(batch, total, dtype=torch.long, device=device)
    step = model
    if static:
        torch._dynamo.reset()  # a new method's hooks compile afresh, never against the recompile limit
        mode = "reduce-overhead" if device.type == "cuda" else "default"
        step = torch.compile(model, fullgraph=True, backend=backend, mode=mode)
    reset_peak(device)
    with torch.no_grad():
        start = clock.now()
        out = model(
            ids, attention_mask=mask[:, :length], **cache_argument(cache), use_cache=True, logits_to_keep=1
        )
        prefill = clock.now() - start
        token = out.logits[:, -1:].argmax(-1)
        del out
        start = clock.now()
        for index in range(warmup + decode_tokens):
            if index == warmup:
                start = clock.now()
            at = length + index
            out = step(
                token,
                attention_mask=mask if static else mask[:, : at + 1],
                position_ids=torch.full((batch, 1), at, device=device),
                cache_position=torch.tensor([at], device=device),
                **cache_argument(cache),
                use_cache=True,
            )
            token = out.logits[:, -1:].argmax(-1).clone()  # CUDA graphs reuse their output buffers
        rate = decode_tokens / (clock.now() - start)
    return prefill, rate, peak_bytes(device)


def statistic_times(config: Any, length: int, device: torch.device, dtype: torch.dtype) -> tuple[Any, float]:
    """(reference seconds or "OOM", ours seconds) for all layers, on random q and k of one prompt."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    q = torch.randn(1, heads, length, dim, dtype=dtype, device=device)
    k = torch.randn(1, kv, length, dim, dtype=dtype, device=device)
    valid = torch.ones(1, length, dtype=torch.bool, device=device)
    clock = Clock(device)

    def reference() -> None:
        keys = k.repeat_interleave(heads // kv, dim=1).float()
        logits = q.float() @ keys.transpose(-1, -2) * dim**-0.5
        causal = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
        weights = logits.masked_fill(causal, float("-inf")).softmax(-1)
        last = weights[0, :, -1]
        (last >= 3 * last.mean(-1, keepdim=True)).float().mean(-1)

    def ours() -> None:
        position_awareness(q[:, :, -1], k, valid, dim**-0.5, 3.0)

    def timed(fn: Callable[[], None]) -> float:
        fn()  # warm up kernels
        start = clock.now()
        fn()
        return clock.now() - start

    layers = config.num_hidden_layers
    try:
        reference_seconds: Any = layers * timed(reference)
    except torch.cuda.OutOfMemoryError:
        reference_seconds = "OOM"
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return reference_seconds, layers * timed(ours)


def measure(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for shape in args.shapes:
        config = SHAPES[shape]()
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        methods = methods_for(config)
        names = [m for m in args.methods if m in methods]
        print(f"\n## {shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, {dtype}")
        for length in args.lengths:
            for batch in args.batches:
                ids = torch.randint(3, config.vocab_size, (batch, length), device=device)
                for path in args.paths:
                    cells: dict[str, list[Any]] = {name: [] for name in names}
                    for _ in range(args.repeats):  # interleaved, so drift hits every method alike
                        for name in names:
                            try:
                                with rescaled(model, methods[name]):
                                    cells[name].append(
                                        run_once(
                                            model, ids, path, args.decode_tokens, args.warmup, args.backend
                                        )
                                    )
                            except torch.cuda.OutOfMemoryError:
                                cells[name].append(None)
                                torch.cuda.empty_cache()
                    rows.extend(report(shape, length, batch, path, cells))
                reference, ours = statistic_times(config, length, device, dtype)
                shown = reference if isinstance(reference, str) else f"{reference:.3f} s"
                print(
                    f"Ms-PoE statistic, {length} tokens, all layers: reference full T x T fp32 {shown}, "
                    f"last row only {ours:.4f} s"
                )
                rows.append(
                    {
                        "shape": shape,
                        "length": length,
                        "statistic_reference_s": reference,
                        "statistic_ours_s": ours,
                    }
                )
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def report(
    shape: str, length: int, batch: int, path: str, cells: dict[str, list[Any]]
) -> list[dict[str, Any]]:
    """Best of the repeats per method (other work only ever slows a run), with ratios to "none"."""
    best: dict[str, tuple[float, float, int] | None] = {}
    for name, runs in cells.items():
        done = [r for r in runs if r is not None]
        best[name] = (
            (min(r[0] for r in done), max(r[1] for r in done), max(r[2] for r in done)) if done else None
        )
    base = best.get("none")
    print(f"\n{shape}, {length} prompt tokens, batch {batch}, {path} path")
    header = ("prefill s", "ratio", "decode tok/s", "ratio", "peak GiB", "ratio")
    print(f"{'method':18} " + " ".join(f"{h:>{max(len(h), 6)}}" for h in header))
    rows = []
    for name, values in best.items():
        if values is None:
            print(f"{name:18} {'OOM':>9}")
            rows.append(
                {"shape": shape, "length": length, "batch": batch, "path": path, "method": name, "oom": True}
            )
            continue
        prefill, rate, peak = values
        ratios = (
            (prefill / base[0], rate / base[1], peak / base[2] if base[2] else float("nan"))
            if base
            else (float("nan"),) * 3
        )
        print(
            f"{name:18} {prefill:9.3f} {ratios[0]:6.3f} {rate:12.1f} {ratios[1]:6.3f} "
            f"{peak / 2**30:8.2f} {ratios[2]:6.3f}"
        )
        rows.append(
            {
                "shape": shape,
                "length": length,
                "batch": batch,
                "path": path,
                "method": name,
                "prefill_s": prefill,
                "decode_tok_s": rate,
                "peak_bytes": peak,
                "prefill_ratio": ratios[0],
                "decode_ratio": ratios[1],
                "memory_ratio": ratios[2],
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shapes", nargs="+", choices=[s for s in SHAPES if s != "tiny"], default=["llama3-8b", "qwen2.5-7b"]
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--paths", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"])
    parser.add_argument("--methods", nargs="+", default=list(methods_for(SHAPES["tiny"]())))
    parser.add_argument("--decode-tokens", type=int, default=64, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=3, help="decode steps before timing (compilation)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled path")
    parser.add_argument("--json", default=None, help="also write every row to this JSON file")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU, to check the script")
    args = parser.parse_args()
    if args.smoke:
        args.shapes, args.lengths, args.batches = ["tiny"], [48], [1, 2]
        args.decode_tokens, args.warmup, args.repeats, args.backend = 4, 2, 1, "eager"
        device, dtype = torch.device("cpu"), torch.float32
    elif not torch.cuda.is_available():
        print(
            "bench_gpu.py measures on a CUDA GPU, and torch sees none here "
            f"(torch {torch.__version__}{', a CPU-only build' if torch.version.cuda is None else ''}). "
            "Run it on a machine with an NVIDIA GPU and a CUDA build of torch, or pass --smoke to check "
            "the script on a tiny shape on the CPU.",
            file=sys.stderr,
        )
        return 2
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        print(
            f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}"
        )
    rows = measure(args, device, dtype)
    print("json:", json.dumps(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
