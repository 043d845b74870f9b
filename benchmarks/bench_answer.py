"""Seconds per RAG answer: the unquantised model (bf16, or float32 on a CPU without native bf16),
the default answering path, the default path with the shipped method, and llama.cpp on the same
GGUF where llama-cpp-python is installed; on request a method not shipped (`--candidate`) and the
default path on a quantised model (`--quantize`), with and without the method.

"bf16" loads the model with `quantize="none"` and decodes plainly (named "float32" where this CPU
loads float32, without native bf16, and every "bf16" key below with it); "default" is what
`Engine.load` gives without arguments (`quantize="auto"`: on a bf16 CPU int8-prompt for the 0.5B,
int8-prompt+int4-decoding for the 1.5B; int8-decoding / int4-decoding in float32) with its
prompt-lookup drafts. `decode_vs_bf16` compares their decoding alone (the time after the first
piece of text, per token after the first); `drift_max_nats_per_token` is the largest change of the
gold answer's log-likelihood per token, default against bf16, over the prompts. The shipped
method's ranking runs once before the timing (its positional-bias estimate is made once per model
and kept).

    python benchmarks/bench_answer.py --quick        # 4 prompts; the full run takes 12
    python benchmarks/bench_answer.py --model qwen2.5-coder-1.5b-instruct --prompts 3 --new-tokens 32 \
        --data docs/results/nq20-1.5b/validation-20.jsonl.gz

Real 10-document NQ-open prompts (the search half: nothing validated is read; `--data` takes
another build-qa file, such as the 1.5B's 20-document prompts, where its method ships), greedy answers of
`--new-tokens` tokens (32, as NQ needs) and of 128, with the gold passage in the middle (where the
method moves it first) and first (where a retriever mostly ranks it, and the order stays: the
answer then starts from the rows the ranking pass read). The paths take turns prompt by prompt in
one process, one thread, each answer from a cold engine (no rows kept from another path), so the
ratios compare like with like on a machine whose speed drifts. `speculative_identical` is true
when the default path's answers (drafted from the prompt) equal plain greedy decoding's on the
same model (an untimed pass); `default_same_as_bf16` when they equal bf16's. One JSON line on
stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from bench_cpu_inference import DATA
from bench_llama_cpp import joined_gguf

GOLD_SLOTS = ("middle", "first")  # the gold passage in the middle (fifth of ten), or first


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="an embedded model's name")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="4 prompts")
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[32, 128])
    parser.add_argument(
        "--data",
        default=str(DATA),
        help="prompts (a build-qa file; default: the 10-document search half), e.g. "
        "docs/results/nq20-1.5b/validation-20.jsonl.gz for the 1.5B's method where it ships",
    )
    parser.add_argument(
        "--candidate",
        metavar="SPEC",
        help="a method not shipped (a name or a saved config's path) timed on the default path too",
    )
    parser.add_argument(
        "--quantize",
        metavar="SCHEME",
        help="also time the answer drafted on a model quantised so (int8, int4, int4-exact, int8-prompt), "
        "without and with the shipped method",
    )
    args = parser.parse_args()
    import torch

    from rag_mspoe.engine import Engine
    from rag_mspoe.eval.data.loaders import load_qa
    from rag_mspoe.eval.data.prompts import qa_prompt
    from rag_mspoe.eval.data.records import with_gold_at
    from rag_mspoe.models.quantization import quantization_of

    torch.set_num_threads(1)
    engine = Engine.load(args.model, threads=1)  # answering's default scheme ("auto")
    scheme = quantization_of(engine.model)
    # Where the default is unquantised itself, one copy of the model serves both paths.
    bf16 = engine if scheme is None else Engine.load(args.model, threads=1, quantize="none")
    reference = "bf16" if bf16.model.dtype == torch.bfloat16 else str(bf16.model.dtype).removeprefix("torch.")
    default_lookup = engine.prompt_lookup_tokens
    count = 4 if args.quick else args.prompts
    examples = load_qa(args.data)[:count]
    paths = {
        reference: (bf16, 0, "none"),
        "default": (engine, default_lookup, "none"),
        "default+method": (engine, default_lookup, "calibrated"),
        **({"default+candidate": (engine, default_lookup, args.candidate)} if args.candidate else {}),
    }
    if args.quantize:
        quantized = Engine.load(args.model, threads=1, quantize=args.quantize)
        paths[args.quantize] = (quantized, quantized.prompt_lookup_tokens, "none")
        paths[f"{args.quantize}+method"] = (quantized, quantized.prompt_lookup_tokens, "calibrated")
    llm = _llama_cpp(args.model)
    names = [*paths, *(["llama_cpp"] if llm is not None else [])]
    result: dict[str, Any] = {
        "model": args.model,
        "prompts": count,
        "documents": len(examples[0].documents),
        "threads": 1,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    if args.candidate:
        result["candidate"] = args.candidate
    if args.quantize:
        result["quantize"] = args.quantize
    prompts = {
        gold: [qa_prompt(with_gold_at(e, _gold_slot(gold, len(e.documents)))) for e in examples]
        for gold in GOLD_SLOTS
    }
    engine.rewritten([prompts["middle"][0]], method="calibrated")  # the bias estimate, untimed
    for tokens in args.new_tokens:
        for gold in GOLD_SLOTS:
            key = f"{tokens}_tokens" if gold == "middle" else f"{tokens}_tokens_gold_first"
            label = f"{tokens} tokens, gold {gold}"
            timed = _timed_paths(llm, paths, names, prompts[gold], tokens, label, args.quantize, reference)
            result[key] = timed
    lookup = f", prompt lookup {default_lookup} tokens" if default_lookup else ""
    result["default_path"] = f"{scheme or reference}{lookup}"
    result[f"decode_vs_{reference}"] = _decode_ratios(result, reference)
    answers = [e.answers[0] for e in examples]  # as bench_cpu_inference scores them
    result["drift_max_nats_per_token"] = _drift_max(bf16, engine, prompts["middle"], answers)
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))


def _gold_slot(gold: str, documents: int) -> int:
    """The gold passage's index: first, or the middle's (4 of 10, 9 of 20)."""
    return 0 if gold == "first" else documents // 2 - 1


def _timed_paths(
    llm: Any,
    paths: dict[str, tuple[Any, int, str]],
    names: list[str],
    prompts: list[Any],
    tokens: int,
    label: str,
    quantized: str | None,
    reference: str,
) -> dict[str, Any]:
    """Each path's mean seconds per answer over `prompts`, the paths taking turns, and its ratios
    (`reference`: the unquantised path's name, "bf16" or "float32")."""
    seconds: dict[str, list[float]] = {name: [] for name in names}
    answers: dict[str, list[str]] = {name: [] for name in paths}
    decoding: dict[str, list[tuple[float, int]]] = {reference: [], "default": []}
    for number, prompt in enumerate(prompts):
        for name in names if number % 2 == 0 else reversed(names):
            engine = paths[reference][0] if name == "llama_cpp" else paths[name][0]
            engine.document_prefixes.clear()  # a cold start: no rows another path read
            started = time.perf_counter()
            if name == "llama_cpp":
                _llama_answer(llm, engine, prompt, tokens)
            else:
                _, engine.prompt_lookup_tokens, method = paths[name]
                text, first_piece, count = _streamed(engine, prompt, tokens, method, started)
                answers[name].append(text)
                if name in decoding:
                    decoding[name].append((time.perf_counter() - first_piece, count - 1))
            seconds[name].append(time.perf_counter() - started)
            print(
                f"{label}, prompt {number + 1}/{len(prompts)}, {name}: {seconds[name][-1]:.1f} s",
                file=sys.stderr,
            )
    mean = {name: sum(values) / len(values) for name, values in seconds.items()}
    plain = [_plain_answer(paths["default"][0], prompt, tokens) for prompt in prompts]
    return {
        "seconds_per_answer": {name: round(value, 2) for name, value in mean.items()},
        # decoding alone: seconds per token after the first, unquantised against the default path
        "decode_seconds_per_token": {
            name: round(sum(s for s, _ in runs) / max(1, sum(n for _, n in runs)), 4)
            for name, runs in decoding.items()
        },
        f"default_vs_{reference}": round(mean[reference] / mean["default"], 2),
        "method_vs_unmodified": round(mean["default+method"] / mean["default"], 2),
        # drafted answers against plain greedy decoding of the same model, and the unquantised model's
        "speculative_identical": answers["default"] == plain,
        f"default_same_as_{reference}": answers["default"] == answers[reference],
        **({"method_vs_llama_cpp": round(mean["default+method"] / mean["llama_cpp"], 2)} if llm else {}),
        **(
            {"candidate_vs_unmodified": round(mean["default+candidate"] / mean["default"], 2)}
            if "default+candidate" in mean
            else {}
        ),
        # The quantised paths: how much sooner than the default they answer (the method on and off),
        # and whether their answers are the unquantised ones (quantisation may change a token).
        **(_quantized_ratios(quantized, mean, answers, llm is not None, reference) if quantized else {}),
    }


def _plain_answer(engine: Any, prompt: Any, tokens: int) -> str:
    """The model's plain greedy answer (untimed; no drafts, no rows kept from another path)."""
    engine.document_prefixes.clear()
    engine.prompt_lookup_tokens = 0
    return str(engine.generate(prompt, max_new_tokens=tokens, method="none").text)


def _streamed(engine: Any, prompt: Any, tokens: int, method: str, started: float) -> tuple[str, float, int]:
    """The answer's text, when its first piece came (the prompt read and one token decoded) and
    how many tokens it has."""
    stream = engine.stream(prompt, max_new_tokens=tokens, method=method)
    pieces: list[str] = []
    first_piece = started
    for piece in stream:
        if not pieces:
            first_piece = time.perf_counter()
        pieces.append(piece)
    return "".join(pieces), first_piece, stream.result.completion_tokens


def _decode_ratios(result: dict[str, Any], reference: str) -> dict[str, float]:
    """Per answer setting, how many times as fast as the unquantised path the default path decodes."""
    ratios = {}
    for key, timed in result.items():
        if isinstance(timed, dict) and "decode_seconds_per_token" in timed:
            per_token = timed["decode_seconds_per_token"]
            ours = per_token["default"]
            ratios[key] = round(per_token[reference] / ours, 2) if ours else 0.0
    return ratios


def _drift_max(bf16: Any, engine: Any, prompts: list[Any], answers: list[str]) -> float:
    """The largest change of the gold answer's log-likelihood per token (nats), default against
    bf16 (0 when the default is bf16 itself)."""
    if engine is bf16:
        return 0.0
    changes = []
    for prompt, answer in zip(prompts, answers, strict=True):
        ((base, count),) = bf16.score_continuations(prompt, [answer], method="none")
        ((ours, _),) = engine.score_continuations(prompt, [answer], method="none")
        changes.append(abs(ours - base) / count)
    return round(max(changes), 4)


def _quantized_ratios(
    scheme: str, mean: dict[str, float], answers: dict[str, list[str]], llama_cpp: bool, reference: str
) -> dict[str, Any]:
    method = f"{scheme}+method"
    return {
        f"{scheme}_vs_default": round(mean["default"] / mean[scheme], 2),
        f"{method}_vs_default+method": round(mean["default+method"] / mean[method], 2),
        f"{scheme}_same_answers": answers[scheme] == answers[reference],
        f"{method}_same_answers": answers[method] == answers["default+method"],
        **({f"{method}_vs_llama_cpp": round(mean[method] / mean["llama_cpp"], 2)} if llama_cpp else {}),
    }


def _llama_cpp(name: str) -> Any:
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed: llama.cpp left out", file=sys.stderr)
        return None
    from llama_cpp_layout import use_plain_weight_layout

    use_plain_weight_layout()
    with joined_gguf(name) as gguf:  # llama.cpp maps the file: a joined copy may go once loaded
        return llama_cpp.Llama(
            model_path=str(gguf), n_ctx=4096, n_threads=1, n_threads_batch=1, verbose=False
        )


def _llama_answer(llm: Any, engine: Any, prompt: str, tokens: int) -> None:
    """llama.cpp's greedy answer to the same token ids our engine reads (chat template included)."""
    from rag_mspoe.prompts.chat_template import render

    llm.reset()
    llm.eval(render(engine.tokenizer, prompt))
    for _ in range(tokens):
        token = llm.sample(temp=0.0)
        if token == llm.token_eos():
            break
        llm.eval([token])


if __name__ == "__main__":
    main()
