"""Cost of the attention-level methods (attention calibration, PINE) against the unmodified model.

    python benchmarks/bench_attention_methods.py --documents 10 20 --repeats 2
    python benchmarks/bench_attention_methods.py --model qwen2.5-coder-0.5b-instruct --documents 10

Prompts are the packer's QA prompt through the chat template, with documents of about
`--words` words each. Prints, per number of documents: prefill seconds and ratio, decode
tokens/s and ratio (greedy, cached), and the peak resident memory of a prefill (measured in a
fresh process per method, whole process and above the loaded model). Attention calibration
uses a positional bias estimated once for the layout (its time is printed too).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import bench_rescale  # a sibling script: the same timing loop
import torch

from rag_mspoe import load_model, rescaled
from rag_mspoe.attention import document_spans, estimate_positional_bias
from rag_mspoe.attention.spans import prompt_with_spans
from rag_mspoe.methods import AttentionCalibration, Pine
from rag_mspoe.prompts.qa_prompt import render_qa_prompt

METHODS = ["none", "attention-calibration", "pine"]
# Words the synthetic documents are made of; each document takes its own sequence of them.
VOCABULARY = (
    "harbour lantern bridge flood bakery square river mill orchard archive keeper ship cape tide market "
    "lamp stone road tower bell garden winter summer ferry island canal school clock"
)
WORDS = VOCABULARY.split(" ")  # noqa: SIM905 (one readable line of words)


def documents_prompt(tokenizer, count: int, words: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The token ids of a QA prompt over `count` distinct documents, and their token spans."""
    documents = []
    for index in range(count):
        text = " ".join(WORDS[(index * 7 + i * 3) % len(WORDS)] for i in range(words))
        documents.append((f"Record {index}", f"{text}."))
    prompt, char_spans = render_qa_prompt("Which record mentions the ferry first?", documents)
    ids, spans = prompt_with_spans(tokenizer, prompt, char_spans)
    return torch.tensor([ids]), spans


def method_config(name: str, bias: Path) -> AttentionCalibration | Pine | None:
    if name == "attention-calibration":
        return AttentionCalibration(bias=str(bias))
    if name == "pine":
        return Pine()
    if name == "none":
        return None
    raise ValueError(f"Unknown method {name!r}; use {METHODS}.")


def prefill_and_decode(model, ids, spans, new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens per second) with greedy cached decoding, spans given."""
    with document_spans(model, [spans]):
        return bench_rescale.prefill_and_decode(model, ids, new_tokens)


def peak_prefill_memory(
    source: str | None, method: str, count: int, words: int, bias: Path
) -> tuple[int, int]:
    """In this process: (resident bytes above the loaded model, whole-process bytes) at a prefill's peak."""
    model, tokenizer = load_model(source)
    ids, spans = documents_prompt(tokenizer, count, words)
    with rescaled(model, method_config(method, bias)), torch.no_grad():
        with document_spans(model, [[]]):
            model(ids[:, :16])  # warm up allocator paths (a prompt without documents)
        base, peak, done = bench_rescale.rss_bytes(), [0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], bench_rescale.rss_bytes())
                time.sleep(0.0005)

        sampler = threading.Thread(target=sample)
        sampler.start()
        with document_spans(model, [spans]):
            model(ids, use_cache=True)
        done.set()
        sampler.join()
    return max(peak[0] - base, 0), peak[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="an embedded model name or a folder (default: SmolLM2)")
    parser.add_argument("--documents", type=int, nargs="+", default=[10, 20])
    parser.add_argument("--words", type=int, default=90, help="words per document (~130 tokens)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--no-memory", action="store_true", help="skip the per-method memory processes")
    parser.add_argument("--bias", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--memory-probe", nargs=2, metavar=("METHOD", "DOCUMENTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_probe:
        method, count = args.memory_probe[0], int(args.memory_probe[1])
        print(*peak_prefill_memory(args.model, method, count, args.words, args.bias))
        return

    model, tokenizer = load_model(args.model)
    bias = Path(tempfile.mkdtemp()) / "bias.json"
    start = time.perf_counter()
    estimate_positional_bias(model, tokenizer, args.documents, save=bias)
    estimate_seconds = time.perf_counter() - start
    name = args.model or "embedded SmolLM2-135M-Instruct"
    print(f"model: {name}, dtype {model.dtype}, threads {args.threads}")
    print(
        f"positional bias for {args.documents} documents estimated in {estimate_seconds:.2f} s (once, cached)"
    )
    for count in args.documents:
        ids, spans = documents_prompt(tokenizer, count, args.words)
        prefill: dict[str, list[float]] = {m: [] for m in args.methods}
        decode: dict[str, list[float]] = {m: [] for m in args.methods}
        for method in args.methods:  # warm up every method's code paths once
            with rescaled(model, method_config(method, bias)):
                prefill_and_decode(model, ids, spans, 2)
        for _ in range(args.repeats):  # interleave methods so drift hits all of them alike
            for method in args.methods:
                with rescaled(model, method_config(method, bias)):
                    seconds, rate = prefill_and_decode(model, ids, spans, args.decode_tokens)
                prefill[method].append(seconds)
                decode[method].append(rate)
        times = {"documents": count, "prefill_s": prefill, "decode_tok_s": decode}
        print("timings:", json.dumps(times), flush=True)  # kept even if a memory probe fails
        memory: dict[str, tuple[int, int]] = {}
        if not args.no_memory:
            for method in args.methods:
                probe = [sys.executable, __file__, "--threads", str(args.threads), "--words", str(args.words)]
                probe += ["--bias", str(bias), "--memory-probe", method, str(count)]
                probe += ["--model", args.model] if args.model else []
                out = subprocess.run(probe, check=True, capture_output=True, text=True).stdout.split()[-2:]
                memory[method] = (int(out[0]), int(out[1]))
        # Best of the repeats: other processes on the machine only ever make a run slower.
        base_prefill, base_decode = min(prefill["none"]), max(decode["none"])
        print(f"\n{count} documents, {ids.shape[1]} prompt tokens (best of {args.repeats})")
        header = ["prefill s", "ratio", "decode tok/s", "ratio", "peak MiB", "above MiB"]
        print(f"{'method':22} " + " ".join(f"{h:>{max(len(h), 6)}}" for h in header))
        rows = {}
        for method in args.methods:
            p, d = min(prefill[method]), max(decode[method])
            above, whole = memory.get(method, (0, 0))
            rows[method] = {
                "prefill_s": p,
                "prefill_ratio": p / base_prefill,
                "decode_tok_s": d,
                "decode_ratio": d / base_decode,
                "peak_mib": whole / 2**20,
                "above_model_mib": above / 2**20,
            }
            print(
                f"{method:22} {p:9.3f} {p / base_prefill:6.2f} {d:12.1f} {d / base_decode:6.2f} "
                f"{whole / 2**20:9.0f} {above / 2**20:9.0f}"
            )
        print("json:", json.dumps({"documents": count, "prompt_tokens": ids.shape[1], "methods": rows}))


if __name__ == "__main__":
    main()
