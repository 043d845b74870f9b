"""Decoding speed and score drift of weight-only int4/int8 against bf16 (and llama.cpp where installed).

    python benchmarks/bench_decode.py --quick                 # 0.5B, 1 thread, 4 prompts: one JSON line
    python benchmarks/bench_decode.py --prompts 20 --new-tokens 4     # the drift on 20 prompts
    python benchmarks/bench_decode.py --memory qwen2.5-coder-1.5b-instruct

Prompts are real 10-document NQ-open prompts (`bench_cpu_inference.py` builds them: gold document
at position 4). Every path reads the same token ids: a prefill (logits at the last position),
then `--new-tokens` greedy steps on its KV cache; the paths alternate prompt by prompt in one
process, so the machine's changing load hits each alike: compare within one run. Each path also
scores the gold answer under the prompt (`Engine.score_continuations`); the drift is the change of
that log-likelihood per token against bf16. llama.cpp (llama-cpp-python) runs the embedded
model's GGUF file as it is, on the same token ids, when the package is installed.

int4-exact quantises from the converted GGUF's float32 values (`rag_mspoe.models.int4_grid`): int4 where
the file stored a 4-bit grid, int8 elsewhere; int4-exact-bf16 keeps those other layers in bf16.
Each quantised path reports how many Linear layers and weights went int4 / int8 / none ("layers").

`sweep_generate_speedup` (with --quick, or `--sweep-questions N`): prompts per hour of a
10-document `--metrics generate --max-new-tokens 64` sweep batch in bf16, answers decoded
together after one prefill per prompt against one left-padded batch (`bench_sweep_generate.py`).

--memory NAME loads the model in a fresh process per path (bf16, then each quantisation) and
reports the bytes of its weights, its resident memory once loaded, and the peak while loading.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from bench_cpu_inference import DATA, GOLD_POSITION, prefill_and_decode, progress, prompt_ids, rates
from bench_sweep_generate import sweep_generate

# int4-exact-bf16: int4-exact with the layers off the file's 4-bit grid kept in bf16 (not int8);
# int8-prompt: the prompt read in int8 in the MLP's gate and up projections, decoding in bf16;
# int8-prompt+int4: that read, decoding on the file's 4-bit codes where it has them;
# int8-prompt+int4-decoding: and on int8 codes elsewhere, the output layer included.
PATHS = (
    "bf16",
    "int8",
    "int4",
    "int4-exact",
    "int4-exact-bf16",
    "int8-prompt",
    "int8-prompt+int4",
    "int8-prompt+int4-decoding",
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument(
        "--quick", action="store_true", help="4 prompts, 32 new tokens, bf16/int8/int4/int4-exact"
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=["bf16", "int8", "int4"])
    parser.add_argument(
        "--memory", metavar="MODEL", help="only measure this model's resident memory per path"
    )
    parser.add_argument(
        "--sweep-questions",
        type=int,
        default=0,
        help="questions (x4 gold positions) of the generate-sweep speed-up (--quick: 2; 0: skip it)",
    )
    args = parser.parse_args()
    if args.memory:
        if "int4-exact-bf16" in args.paths:
            parser.error("--memory loads each path by its --quantize value; int4-exact-bf16 has none")
        print(json.dumps(memory(args.memory, args.paths)), flush=True)
        return
    if args.quick:
        args.prompts, args.new_tokens, args.paths = 4, 32, ["bf16", "int8", "int4", "int4-exact"]
        args.sweep_questions = args.sweep_questions or 2
    print(json.dumps(decode_run(args)), flush=True)


def decode_run(args: argparse.Namespace) -> dict[str, Any]:
    from rag_mspoe import load_model
    from rag_mspoe.engine import Engine
    from rag_mspoe.eval.data.loaders import load_qa
    from rag_mspoe.eval.data.prompts import qa_prompt
    from rag_mspoe.eval.data.records import with_gold_at
    from rag_mspoe.models.loading import resolve_source
    from rag_mspoe.models.quantization import quantization_census

    bf16, tokenizer = load_model(args.model, dtype="bfloat16", threads=args.threads)
    folder = resolve_source(args.model)[0]
    models = {p: bf16 if p == "bf16" else _quantized(bf16, p, folder) for p in args.paths}
    runners = {name: _ours(model) for name, model in models.items()}
    llama = _llama_cpp(args.model, args.threads)
    crashed = llama if isinstance(llama, str) else None
    if crashed:
        llama = None
    if llama is not None:
        runners["llama_cpp"] = llama
    examples = load_qa(DATA)[: args.prompts]
    items = [(qa_prompt(with_gold_at(e, GOLD_POSITION)), e.answers[0]) for e in examples]
    seconds: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    gold: dict[str, list[float]] = {name: [] for name in models}
    tokens = 0
    started = time.perf_counter()
    for number, (prompt, answer) in enumerate(items):
        ids = prompt_ids(tokenizer, prompt)
        tokens += ids.shape[1]
        for name in list(runners) if number % 2 == 0 else list(reversed(runners)):
            seconds[name].append(runners[name](ids, args.new_tokens))
            progress("decode", number, len(items), name, seconds[name][-1])
        for name, model in models.items():
            total, count = Engine(model, tokenizer, method="none").score_continuations(prompt, [answer])[0]
            gold[name].append(total / count)
    measured = rates(seconds, tokens, args.new_tokens)
    decode = {name: rate["decode_tokens_per_s"] for name, rate in measured.items()}
    drift = {
        name: [abs(a - b) for a, b in zip(gold[name], gold["bf16"], strict=True)]
        for name in models
        if name != "bf16" and "bf16" in gold
    }
    sweep = {"sweep_generate_speedup": None}
    if args.sweep_questions:
        sweep = sweep_generate(bf16, tokenizer, questions=args.sweep_questions, repeats=2)
    return {
        "model": args.model,
        "threads": args.threads,
        "prompts": len(items),
        "mean_prompt_tokens": round(tokens / len(items), 1),
        "new_tokens": args.new_tokens,
        "decode_tok_s": decode,
        "prefill_tok_s": {name: rate["prefill_tokens_per_s"] for name, rate in measured.items()},
        "decode_vs_bf16": {name: round(rate / decode["bf16"], 2) for name, rate in decode.items()}
        if "bf16" in decode
        else None,
        "decode_vs_llama_cpp": {name: round(rate / decode["llama_cpp"], 2) for name, rate in decode.items()}
        if llama is not None
        else None,
        "llama_cpp_status": _llama_cpp_status(llama is not None, crashed),
        "max_abs_loglik_diff_per_token": {name: round(max(d), 4) for name, d in drift.items()},
        "mean_abs_loglik_diff_per_token": {name: round(statistics.fmean(d), 4) for name, d in drift.items()},
        "layers": {name: quantization_census(model) for name, model in models.items() if name != "bf16"},
        **sweep,
        "seconds": round(time.perf_counter() - started, 1),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def _quantized(bf16: Any, path: str, folder: str) -> Any:
    from rag_mspoe.models.quantization import quantize_model

    scheme, fallback = ("int4-exact", "none") if path == "int4-exact-bf16" else (path, "int8")
    return quantize_model(copy.deepcopy(bf16), scheme, folder, fallback)


def _ours(model: Any) -> Any:
    return lambda ids, steps: prefill_and_decode(model, ids, steps)


_LLAMA_CPP_PROBE = """
import sys
import llama_cpp
from llama_cpp_layout import use_plain_weight_layout
use_plain_weight_layout()
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=4096, n_batch=512, n_threads=1, verbose=False)
llm.eval(list(range(100, 164)))
"""


def _llama_cpp_status(measured: bool, crashed: str | None = None) -> str:
    if crashed:
        return crashed
    if not measured:
        return "llama-cpp-python not installed"
    import llama_cpp

    return f"measured with llama-cpp-python {llama_cpp.__version__}"


def _llama_cpp_crash(gguf: Any) -> str | None:
    """Why llama.cpp cannot run here, from a probe in a child process (a build can fault on a
    CPU it was not made for, which would end this process), or None when it runs."""
    here = os.path.dirname(os.path.abspath(__file__))  # the child imports llama_cpp_layout from here
    probe = subprocess.run(
        [sys.executable, "-c", _LLAMA_CPP_PROBE, str(gguf)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))},
    )
    if probe.returncode == 0:
        return None
    return f"llama.cpp crashed evaluating a 64-token prompt (exit status {probe.returncode}): not measured"


def _llama_cpp(name: str, threads: int) -> Any:
    """A runner of the model's GGUF file in llama.cpp (same token ids, greedy), None if not
    installed, or why it cannot run here (a string)."""
    try:
        import llama_cpp
    except ImportError:
        return None
    from bench_llama_cpp import joined_gguf
    from llama_cpp_layout import use_plain_weight_layout

    use_plain_weight_layout()
    stack = joined_gguf(name)
    gguf = stack.__enter__()  # kept joined for the whole run; the process ends with it
    crash = _llama_cpp_crash(gguf)
    if crash is not None:
        print(crash, file=sys.stderr, flush=True)
        return crash
    llm = llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=4096,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )

    def run(ids: Any, steps: int) -> tuple[float, float]:
        llm.reset()
        started = time.perf_counter()
        llm.eval(ids[0].tolist())
        prefilled = time.perf_counter()
        for _ in range(steps):
            llm.eval([llm.sample(temp=0.0)])
        return prefilled - started, time.perf_counter() - prefilled

    return run


_MEMORY_PROBE = """
import gc, json, resource, sys
import psutil
from rag_mspoe import load_model
path = sys.argv[2]
model, _ = load_model(sys.argv[1], dtype="bfloat16", threads=1, quantize=None if path == "bf16" else path)
gc.collect()
tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
print(json.dumps({"weights_mib": round(sum(t.numel() * t.element_size() for t in tensors) / 2**20),
                  "rss_mib": round(psutil.Process().memory_info().rss / 2**20),
                  "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))
"""


def memory(name: str, paths: list[str]) -> dict[str, Any]:
    """Resident memory of `name` loaded in each path, each in a fresh process."""
    result: dict[str, Any] = {"model": name}
    for path in paths:
        out = subprocess.run(
            [sys.executable, "-c", _MEMORY_PROBE, name, path], capture_output=True, text=True, check=True
        )
        result[path] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"memory {path}: {result[path]}", file=sys.stderr, flush=True)
    return result


if __name__ == "__main__":
    main()
