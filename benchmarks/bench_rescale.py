"""Cost of each method on the embedded model, as ratios against the unmodified model in the same run.

    python benchmarks/bench_rescale.py --lengths 1024 4096 --repeats 3

Prints, per prompt length: prefill time ratio, decode tokens/s ratio and peak memory ratio for
each method, and the time of the Ms-PoE statistic done the reference's way (a full T x T
attention matrix per layer) against ours (the last prompt row only).
Peak memory is measured in a fresh process per method (resident set sampled during prefill,
above the loaded model), so one method's freed memory cannot hide another's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

import torch

from rag_mspoe import Compose, LayerWise, MsPoE, Uniform, load_model, rescaled
from rag_mspoe.rope.awareness import position_awareness
from rag_mspoe.rope.hooks import cache_argument, returned_cache

METHODS = {
    "none": None,
    "uniform": Uniform(1.5),
    "layerwise": LayerWise(
        control_points=[(0.0, 1.0), (0.33, 1.8), (0.67, 1.6), (1.0, 1.2)], x_is_fraction=True
    ),
    "layerwise+pi": Compose([LayerWise(factors=[1.0] * 15 + [1.3] * 15), Uniform(1.2)]),
    "mspoe-static": MsPoE(head_order=[[0, 1, 2]] * 30),
    "mspoe": MsPoE(),
    "mspoe-query-head": MsPoE(gqa_policy="query_head"),
}


def prompt(tokenizer, length: int) -> torch.Tensor:
    text = "The archive of the lighthouse keeps a record of every ship that passed the cape. " * (length // 8)
    return tokenizer(text, return_tensors="pt")["input_ids"][:, :length]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def prefill_and_decode(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens per second) with greedy cached decoding."""
    with torch.no_grad():
        start = time.perf_counter()
        out = model(ids, use_cache=True)
        prefill = time.perf_counter() - start
        cache, token = returned_cache(out), out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(new_tokens):
            out = model(token, **cache_argument(cache), use_cache=True)
            cache, token = returned_cache(out), out.logits[:, -1:].argmax(-1)
        return prefill, new_tokens / (time.perf_counter() - start)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def peak_prefill_memory(method: str, length: int) -> tuple[int, int]:
    """In this process: (resident bytes above the loaded model, whole-process resident bytes) at the
    peak of one prefill."""
    model, tokenizer = load_model()
    ids = prompt(tokenizer, length)
    with rescaled(model, METHODS[method]), torch.no_grad():
        model(ids[:, :16])  # warm up allocator paths
        base, peak, done = rss_bytes(), [0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], rss_bytes())
                time.sleep(0.0005)

        sampler = threading.Thread(target=sample)
        sampler.start()
        model(ids, use_cache=True)
        done.set()
        sampler.join()
    return max(peak[0] - base, 0), peak[0]


def statistic_times(model, length: int) -> tuple[float, float, int]:
    """(reference full-matrix seconds, ours seconds, bytes of one layer's T x T matrix), all layers."""
    config = model.config
    heads, kv, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q = torch.randn(1, heads, length, dim, dtype=model.dtype)
    k = torch.randn(1, kv, length, dim, dtype=model.dtype)
    valid = torch.ones(1, length, dtype=torch.bool)
    causal = torch.ones(length, length, dtype=torch.bool).triu(1)

    def reference() -> None:
        keys = k.repeat_interleave(heads // kv, dim=1).float()
        weights = (
            (q.float() @ keys.transpose(-1, -2) * dim**-0.5).masked_fill(causal, float("-inf")).softmax(-1)
        )
        last = weights[0, :, -1]
        (last >= 3 * last.mean(-1, keepdim=True)).float().mean(-1)

    def ours() -> None:
        position_awareness(q[:, :, -1], k, valid, dim**-0.5, 3.0)

    layers = config.num_hidden_layers
    return (
        layers * timed(reference),
        layers * timed(ours),
        heads * length * length * 4,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--memory-probe", nargs=2, metavar=("METHOD", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_probe:
        print(*peak_prefill_memory(args.memory_probe[0], int(args.memory_probe[1])))
        return

    model, tokenizer = load_model()
    print(f"model: embedded SmolLM2-135M-Instruct, dtype {model.dtype}, threads {args.threads}")
    for length in args.lengths:
        ids = prompt(tokenizer, length)
        prefill: dict[str, list[float]] = {m: [] for m in args.methods}
        decode: dict[str, list[float]] = {m: [] for m in args.methods}
        for _ in range(args.repeats):  # interleave methods so drift hits all of them alike
            for method in args.methods:
                with rescaled(model, METHODS[method]):
                    seconds, rate = prefill_and_decode(model, ids, args.decode_tokens)
                prefill[method].append(seconds)
                decode[method].append(rate)
        memory, process = {}, {}
        for method in args.methods:
            probe = [
                sys.executable,
                __file__,
                "--threads",
                str(args.threads),
                "--memory-probe",
                method,
                str(length),
            ]
            above, whole = subprocess.run(probe, check=True, capture_output=True, text=True).stdout.split()[
                -2:
            ]
            memory[method], process[method] = int(above), int(whole)
        # Best of the repeats: other processes on the machine only ever make a run slower.
        base_prefill, base_decode = min(prefill["none"]), max(decode["none"])
        print(
            f"\n{length} prompt tokens (best of {args.repeats}; memory: peak resident set of the whole "
            "process, and its part above the loaded model)"
        )
        header = [
            "method",
            "prefill s",
            "ratio",
            "decode tok/s",
            "ratio",
            "peak MiB",
            "ratio",
            "above MiB",
            "ratio",
        ]
        print(f"{header[0]:18} " + " ".join(f"{h:>{max(len(h), 6)}}" for h in header[1:]))
        rows = {}
        for method in args.methods:
            p, d = min(prefill[method]), max(decode[method])
            rows[method] = {
                "prefill_ratio": p / base_prefill,
                "decode_ratio": d / base_decode,
                "memory_ratio": process[method] / process["none"],
                "memory_above_model_ratio": memory[method] / max(memory["none"], 1),
            }
            print(
                f"{method:18} {p:9.3f} {p / base_prefill:6.3f} {d:12.1f} {d / base_decode:6.3f} "
                f"{process[method] / 2**20:8.1f} {rows[method]['memory_ratio']:6.3f} "
                f"{memory[method] / 2**20:9.1f} {rows[method]['memory_above_model_ratio']:6.3f}"
            )
        reference, ours, matrix_bytes = statistic_times(model, length)
        print(
            f"Ms-PoE statistic, all layers: reference full T x T {reference:.3f} s "
            f"({matrix_bytes / 2**20:.0f} MiB per layer), last row only {ours:.4f} s "
            f"({reference / ours:.0f}x faster)"
        )
        print("json:", json.dumps({"length": length, "methods": rows}))


if __name__ == "__main__":
    main()
