"""The `index`, `search`, `ask` and `demo` commands.

    rag-mspoe index docs/ --index my-index
    rag-mspoe search "When was the light first lit?" --index my-index
    rag-mspoe ask "When was the light first lit?" --index my-index --method mspoe
    rag-mspoe demo

Heavy libraries (FAISS, sentence-transformers, torch) are imported only when a command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rag_mspoe.cli import add_engine_options, engine_options
from rag_mspoe.pipelines.chunking import DEFAULT_CHUNK_OVERLAP, DEFAULT_CHUNK_SIZE
from rag_mspoe.pipelines.index import INDEX_KINDS

if TYPE_CHECKING:
    from rag_mspoe.engine.protocol import EngineLike
    from rag_mspoe.pipelines.answer import Answer, Citation
    from rag_mspoe.pipelines.chunking import Chunk
    from rag_mspoe.pipelines.demo import DemoResult, MethodAnswer
    from rag_mspoe.pipelines.retrieval import RetrievedChunk

DEFAULT_INDEX_DIR = "rag-index"


def register(subparsers: Any) -> None:
    _register_index(subparsers)
    _register_search(subparsers)
    _register_ask(subparsers)
    _register_demo(subparsers)


def _register_index(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "index",
        help="index documents (txt, md, html, pdf, jsonl) into a FAISS index on disk, or add to one",
        description="Read, chunk and embed documents into a FAISS index. Running it again on an existing "
        "index adds the documents it does not hold yet.",
    )
    parser.add_argument("paths", nargs="+", help="files or folders (searched recursively)")
    _index_option(parser)
    parser.add_argument(
        "--embedding-model",
        default=None,
        help="sentence-transformers name or folder (default: all-MiniLM-L6-v2, offline; "
        "an existing index keeps its own)",
    )
    parser.add_argument(
        "--chunk-size", type=int, default=None, help=f"tokens per chunk (default {DEFAULT_CHUNK_SIZE})"
    )
    parser.add_argument(
        "--chunk-overlap",
        type=int,
        default=None,
        help=f"tokens shared by neighbouring chunks (default {DEFAULT_CHUNK_OVERLAP})",
    )
    parser.add_argument(
        "--kind",
        choices=INDEX_KINDS,
        default=None,
        help="flat: exact search (default); hnsw or ivf: approximate, for large corpora",
    )
    parser.add_argument("--text-field", default="text", help="JSONL field holding the text (default: text)")
    parser.add_argument("--batch-size", type=int, default=64, help="chunks embedded per batch")
    parser.add_argument(
        "--follow-links",
        action="store_true",
        help="also index files that links inside a folder point to outside it (skipped by default)",
    )
    parser.set_defaults(func=_index)


def _register_search(subparsers: Any) -> None:
    parser = subparsers.add_parser("search", help="show the chunks an index returns for a question")
    parser.add_argument("question")
    _index_option(parser)
    _retrieval_options(parser, default_k=5)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(func=_search)


def _register_ask(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "ask", help="answer a question from an index with the model and its method, citing its documents"
    )
    parser.add_argument("question")
    _index_option(parser)
    _retrieval_options(parser, default_k=5)
    add_engine_options(parser)
    parser.add_argument(
        "--method",
        default="mspoe",
        help="none, pi, pi:2, mspoe, layerwise, layerwise+pi, calibrated (the config shipped for the "
        "model) or a config path",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--reorder",
        action="store_true",
        help="LongContextReorder: best chunks at both ends of the context (default: retrieval order)",
    )
    parser.add_argument(
        "--no-cite",
        action="store_true",
        help="do not ask the model to cite [Document i] (exact benchmark prompt)",
    )
    parser.add_argument("--show-prompt", action="store_true", help="print the packed prompt first")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(func=_ask)


def _register_demo(subparsers: Any) -> None:
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


def _index_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--index", default=DEFAULT_INDEX_DIR, help=f"index folder (default: ./{DEFAULT_INDEX_DIR})"
    )


def _retrieval_options(parser: argparse.ArgumentParser, default_k: int) -> None:
    parser.add_argument("-k", type=int, default=default_k, help=f"chunks to retrieve (default {default_k})")
    parser.add_argument(
        "--embedding-model",
        default=None,
        help="check that the index was built with this embedding model (default: the index's own)",
    )


# -- commands ----------------------------------------------------------------------------------------


def _index(args: argparse.Namespace) -> int:
    from rag_mspoe.pipelines.indexing import index_documents

    report = index_documents(
        args.paths,
        args.index,
        embedding_model=args.embedding_model,
        chunk_size=args.chunk_size,
        chunk_overlap=args.chunk_overlap,
        kind=args.kind,
        text_field=args.text_field,
        batch_size=args.batch_size,
        follow_outside_links=args.follow_links,
    )
    print(report.summary())
    for skipped in report.skipped:
        print(f"  skipped {_show_path(skipped.source)}: {skipped.reason}")
    return 0


def _search(args: argparse.Namespace) -> int:
    from rag_mspoe.pipelines.retrieval import Retriever

    retriever = Retriever.load(args.index, embedding_model=args.embedding_model)
    started = time.perf_counter()
    hits = retriever.retrieve(args.question, args.k)
    seconds = time.perf_counter() - started
    if args.json:
        print(json.dumps([_hit_record(hit) for hit in hits], indent=1, ensure_ascii=False))
        return 0
    for hit in hits:
        print(f"{hit.rank}. {hit.score:.3f}  {_cite_place(hit.chunk)}  {hit.chunk.title}")
        print(f"   {_shorten(hit.chunk.text, 200)}")
    print(f"({len(hits)} chunks in {seconds * 1000:.0f} ms)")
    return 0


def _ask(args: argparse.Namespace) -> int:
    from rag_mspoe import parse_method
    from rag_mspoe.engine import Engine
    from rag_mspoe.models.loading import source_name
    from rag_mspoe.pipelines.answer import answer_question
    from rag_mspoe.pipelines.retrieval import Retriever

    # Fail on a bad method name (or no calibrated config for the model) or a device this machine
    # lacks before loading anything heavy.
    parse_method(args.method, source_name(args.model))
    load_options = engine_options(args)
    retriever = Retriever.load(args.index, embedding_model=args.embedding_model)
    engine = Engine.load(args.model, **load_options)
    answer = answer_question(
        args.question,
        retriever,
        engine,
        k=args.k,
        max_new_tokens=args.max_new_tokens,
        reorder=args.reorder,
        cite=not args.no_cite,
        method=args.method,
    )
    if args.json:
        print(json.dumps(_answer_record(answer), indent=1, ensure_ascii=False))
        return 0
    if args.show_prompt:
        print(answer.packed.prompt, end="\n\n")
    print(answer.text)
    print()
    if answer.citations:
        print("Cited:")
        for citation in answer.citations:
            print(f"  [Document {citation.number}] {_cite_place(citation)}  {citation.title}")
    else:
        print("The answer cites no document.")
    if answer.unknown_citations:
        print(f"  cited but not in the context: {', '.join(map(str, answer.unknown_citations))}")
    order = "LongContextReorder" if answer.packed.reordered else "retrieval order"
    print(f"Context ({order}, {answer.packed.prompt_tokens} of {answer.packed.budget} prompt tokens):")
    for number, item in enumerate(answer.packed.documents, start=1):
        print(f"  [Document {number}] rank {item.rank}, score {item.score:.3f}  {_cite_place(item.chunk)}")
    for item in answer.packed.dropped:
        print(f"  dropped (over the token budget): rank {item.rank}  {_cite_place(item.chunk)}")
    timings = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in answer.timings.items())
    print(f"{engine.name} with method {answer.method}: {timings}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from rag_mspoe import parse_method
    from rag_mspoe.calibrated.validation import load_validations
    from rag_mspoe.engine import Engine
    from rag_mspoe.models.devices import resolve_device, resolve_dtype
    from rag_mspoe.models.loading import default_threads
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
    scheme = load_options.get("quantize")  # None when not quantised ("none" resolved)
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
        from rag_mspoe.pipelines.demo_curve import committed_curve, other_counts

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
    from rag_mspoe.eval.report import PLOT_FILE, TABLE_FILE
    from rag_mspoe.pipelines.demo import CURVE_MAX_NEW_TOKENS, expected_curve_seconds, run_position_curve

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


# -- printing ----------------------------------------------------------------------------------------


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
    text = _shorten(answer.text, 90)
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


def _hit_record(hit: RetrievedChunk) -> dict[str, Any]:
    return {"rank": hit.rank, "score": hit.score, "chunk_id": hit.chunk_id, **asdict(hit.chunk)}


def _answer_record(answer: Answer) -> dict[str, Any]:
    return {
        "question": answer.question,
        "answer": answer.text,
        "method": answer.method,
        "finish_reason": answer.finish_reason,
        "citations": [asdict(c) for c in answer.citations],
        "unknown_citations": answer.unknown_citations,
        "documents": [_hit_record(item) for item in answer.packed.documents],
        "dropped": [_hit_record(item) for item in answer.packed.dropped],
        "reordered": answer.packed.reordered,
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "timings": answer.timings,
    }


def _cite_place(chunk: Chunk | Citation) -> str:
    """file[#location]:start-end (character offsets of the chunk in the document's text)."""
    where = f"#{chunk.location}" if chunk.location else ""
    return f"{_show_path(chunk.source)}{where}:{chunk.start}-{chunk.end}"


def _show_path(path: str) -> str:
    """A path relative to the working folder when it lies below it, else as stored."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


def _shorten(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."
