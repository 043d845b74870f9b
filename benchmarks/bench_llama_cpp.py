"""Prefill and decode tokens/s of llama.cpp beside ours, on the same embedded model's GGUF file.

    pip install llama-cpp-python      # builds llama.cpp from source; not a dependency of rag-mspoe
    python benchmarks/bench_llama_cpp.py --prompts 4 --threads 2

llama.cpp runs the GGUF file as it is (Q4_K_M for the Qwen2.5-Coder models: 4-6 bit weights);
we run the same weights de-quantised, in bf16 and in int8 (`quantize="int8"`). Each path reads
the same token ids (real 10-document prompts, as `bench_cpu_inference.py` builds them), then
decodes `--new-tokens` greedy steps; the paths alternate prompt by prompt in one process.
The GGUF of a chunked embedded model is joined into a temporary folder and removed at the end.
One JSON line on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench_cpu_inference import DATA, GOLD_POSITION, prefill_and_decode, progress, prompt_ids, rates


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="an embedded model's name")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    try:
        import llama_cpp
    except ImportError:
        sys.exit("This benchmark needs llama-cpp-python: pip install llama-cpp-python (builds from source).")
    from rag_mspoe import load_model
    from rag_mspoe.eval.data.loaders import load_qa
    from rag_mspoe.eval.data.prompts import qa_prompt
    from rag_mspoe.eval.data.records import with_gold_at
    from rag_mspoe.models.quantization import quantize_model

    model, tokenizer = load_model(args.model, dtype="bfloat16", threads=args.threads)
    ours = {"bf16": model, "int8": quantize_model(copy.deepcopy(model), "int8")}
    examples = load_qa(DATA)[: args.prompts]
    prompts = [prompt_ids(tokenizer, qa_prompt(with_gold_at(e, GOLD_POSITION))) for e in examples]
    from llama_cpp_layout import use_plain_weight_layout

    use_plain_weight_layout()
    with joined_gguf(args.model) as gguf:
        llm = llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=4096,
            n_batch=512,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            verbose=False,
        )
        paths = ["llama.cpp", *ours]
        seconds: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
        tokens = 0
        for number, ids in enumerate(prompts):
            tokens += ids.shape[1]
            for name in paths if number % 2 == 0 else list(reversed(paths)):
                if name == "llama.cpp":
                    seconds[name].append(llama_prefill_and_decode(llm, ids[0].tolist(), args.new_tokens))
                else:
                    seconds[name].append(prefill_and_decode(ours[name], ids, args.new_tokens))
                progress("llama.cpp", number, len(prompts), name, seconds[name][-1])
    result = rates(seconds, tokens, args.new_tokens)
    print(
        json.dumps(
            {
                "model": args.model,
                "threads": args.threads,
                "prompts": len(prompts),
                "mean_prompt_tokens": round(tokens / len(prompts), 1),
                "new_tokens": args.new_tokens,
                "rates": result,
                "llama_cpp_version": llama_cpp.__version__,
                "load_average": [round(x, 2) for x in os.getloadavg()],
            }
        )
    )


def llama_prefill_and_decode(llm: Any, ids: list[int], steps: int) -> tuple[float, float]:
    """Seconds of llama.cpp's prompt evaluation and of `steps` greedy steps after it."""
    llm.reset()
    started = time.perf_counter()
    llm.eval(ids)
    prefilled = time.perf_counter()
    for _ in range(steps):
        llm.eval([llm.sample(temp=0.0)])  # temperature 0: the most likely token
    return prefilled - started, time.perf_counter() - prefilled


@contextlib.contextmanager
def joined_gguf(name: str) -> Iterator[Path]:
    """The embedded model's GGUF file: the installed one, or its parts joined into a temporary folder."""
    from rag_mspoe.models import embedded_models

    model = embedded_models.get(name)
    paths = embedded_models.installed_parts(model)
    if len(paths) == 1 and paths[0].name == model.gguf_file:
        yield paths[0]
        return
    with tempfile.TemporaryDirectory(prefix="bench-llama-cpp-") as scratch:
        gguf = Path(scratch) / model.gguf_file
        embedded_models.join_parts(model, paths, gguf)
        yield gguf


if __name__ == "__main__":
    main()
