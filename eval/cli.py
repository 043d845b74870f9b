"""The evaluation commands: `sweep`, `report`, `compare`, `perplexity`, `e2e`, `harness` and `suite`.

    rag-mspoe sweep --documents 10 --positions 0,4,9 --methods none pi mspoe --samples 100 --out runs/qa10
    rag-mspoe report runs/qa10
    rag-mspoe compare runs/qa10 runs/qa10-calibrated --out runs/qa10-vs-calibrated
    rag-mspoe perplexity book.txt --lengths 2048 4096 --methods none pi dynamic-ntk --out runs/ppl
    rag-mspoe e2e questions.jsonl corpus/ --methods none mspoe longcontextreorder --out runs/e2e
    rag-mspoe harness --tasks arc_easy --methods none mspoe --limit 200 --out runs/harness
    rag-mspoe suite-data --out data/local
    rag-mspoe build-qa nq-open-oracle.jsonl.gz --pool passages.jsonl --documents 20 --out data/nq20.jsonl.gz
    rag-mspoe suite --longbench hotpotqa.jsonl --mmlu mmlu.jsonl --sweep runs/qa10 --out runs/side

Every command writes into its --out folder and resumes from what it finds there.
Heavy libraries are imported only when a command runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rag_mspoe.cli import add_model_options, model_load_options

DEFAULT_METHODS = ["none", "pi", "mspoe", "layerwise", "longcontextreorder"]


def register(subparsers: Any) -> None:
    _register_sweep(subparsers)
    _register_report(subparsers)
    _register_compare(subparsers)
    _register_perplexity(subparsers)
    _register_e2e(subparsers)
    _register_harness(subparsers)
    _register_suite(subparsers)
    _register_suite_data(subparsers)
    _register_build_qa(subparsers)


def parse_positions(text: str, num_documents: int) -> list[int]:
    """'0,4,9' or 'all' or 'ends' (first, middle, last), counted from 0."""
    if text == "all":
        return list(range(num_documents))
    if text == "ends":
        return sorted({0, (num_documents - 1) // 2, num_documents - 1})
    try:
        return sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ValueError(
            f"--positions {text!r}: give comma-separated indices from 0, 'ends' or 'all'."
        ) from None


def _common_model_options(parser: argparse.ArgumentParser) -> None:
    add_model_options(parser)
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _register_sweep(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "sweep",
        help="gold-position sweep: every method at every gold position on the same examples",
        description="Score each (method, gold position, example) into OUT/results.jsonl, then write the "
        "report. Rerun the same command to resume a stopped run.",
    )
    parser.add_argument("--out", required=True, help="run folder (created; an existing run is resumed)")
    parser.add_argument("--task", choices=["qa", "kv"], default="qa", help="multi-document QA or key-value")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--data", default=None, help="examples file (.jsonl or .jsonl.gz, paper format)")
    source.add_argument(
        "--generator",
        choices=["invented-qa", "kv", "kv-short"],
        default=None,
        help="draw examples instead (default: invented-qa for qa, kv for kv)",
    )
    parser.add_argument("--documents", type=int, default=10, help="documents (QA) or pairs (KV) per prompt")
    parser.add_argument(
        "--positions", default="ends", help="gold positions from 0: '0,4,9', 'ends' (default) or 'all'"
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=DEFAULT_METHODS,
        help="method specs: none, pi, pi:2, mspoe, mspoe:1.2-1.8, layerwise, dynamic-ntk, yarn, "
        "longcontextreorder, random, a config .json, combined with '+' (layerwise+pi), "
        f"optionally labelled (cal=path.json); default: {' '.join(DEFAULT_METHODS)}",
    )
    parser.add_argument("--samples", type=int, default=100, help="examples per position")
    parser.add_argument(
        "--metrics",
        nargs="+",
        choices=["choice", "loglik", "generate"],
        default=["choice"],
        help="choice: forced choice among the answers in the context (and the gold log-likelihood); "
        "loglik: gold log-likelihood only; generate: greedy answer scored by best_subspan_em / KV match",
    )
    parser.add_argument("--similarity", type=float, default=0.5, help="distractor similarity (invented-qa)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generator and of random orders")
    parser.add_argument("--batch-size", type=int, default=8, help="items per batch (and per write)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=100, help="answer length for --metrics generate"
    )
    parser.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="fan out over Ray: alone for a local Ray, or a cluster address (ray://host:10001 or auto)",
    )
    parser.add_argument("--ray-workers", type=int, default=2, help="Ray workers, one model replica each")
    parser.add_argument(
        "--budget-hours",
        type=float,
        default=None,
        help="stop starting batches after this many hours; rerun the same command to go on",
    )
    _common_model_options(parser)
    parser.set_defaults(func=_sweep)


def sweep_config(args: argparse.Namespace) -> Any:
    from rag_mspoe.eval.sweep.plan import SweepConfig

    generator = None if args.data else (args.generator or ("invented-qa" if args.task == "qa" else "kv"))
    return SweepConfig(
        task=args.task,
        num_documents=args.documents,
        positions=tuple(parse_positions(args.positions, args.documents)),
        methods=tuple(args.methods),
        samples=args.samples,
        data=str(Path(args.data).resolve()) if args.data else None,
        generator=generator,
        distractor_similarity=args.similarity,
        seed=args.seed,
        metrics=tuple(args.metrics),
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        model=args.model,
    )


def _sweep(args: argparse.Namespace) -> int:
    from rag_mspoe.eval.sweep.run import run_sweep

    outcome = run_sweep(
        sweep_config(args),
        args.out,
        **model_load_options(args),
        ray_address=args.ray,
        ray_workers=args.ray_workers,
        progress=not args.no_progress,
        budget_hours=args.budget_hours,
    )
    print(f"{outcome.total}/{outcome.expected} records in {outcome.folder} ({outcome.written} new)")
    _print_table(outcome.folder)
    return 0


def _print_table(folder: Path) -> None:
    from rag_mspoe.eval.report import TABLE_FILE

    table = folder / TABLE_FILE
    if table.is_file():
        print(table.read_text())


def _register_report(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "report",
        help="summary JSON, Markdown tables (and a plot) of any run folder (also for a partial run)",
    )
    parser.add_argument("run", help="run folder: sweep, suite, harness, perplexity or e2e")
    parser.add_argument(
        "--metric", default=None, help="choice_correct, match or gold_logprob (default: first)"
    )
    parser.add_argument("--baseline", default="none", help="method the paired tests compare against")
    parser.add_argument("--sweep", default=None, help="for a suite folder: a sweep folder, for the gains")
    parser.set_defaults(func=_report)


def _report(args: argparse.Namespace) -> int:
    """Rewrite the report of any run folder, of the kind its manifest names."""
    from rag_mspoe.eval.runs.loop import Evaluation, folder_kind

    folder = Path(args.run)
    print(Evaluation.registry[folder_kind(folder)].report(folder, args))
    return 0


def _register_compare(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="compare two run folders of one kind method by method: per position (sweep), task (suite), "
        "metric (harness), length (perplexity), or overall (e2e)",
    )
    parser.add_argument("a", help="first run folder")
    parser.add_argument("b", help="second run folder")
    parser.add_argument("--out", default=None, help="folder for comparison.json and comparison.md")
    parser.add_argument("--metric", default=None, help="metric to compare (default: first both have)")
    parser.set_defaults(func=_compare)


def _compare(args: argparse.Namespace) -> int:
    from rag_mspoe.eval.report import compare_runs

    result = compare_runs(Path(args.a), Path(args.b), metric=args.metric, out=args.out)
    print(result["markdown"])
    return 0


def _register_perplexity(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "perplexity", help="perplexity against context length on a long text file, per method"
    )
    parser.add_argument("text", help="a long plain-text file")
    parser.add_argument("--out", required=True, help="run folder (an existing run is resumed)")
    parser.add_argument(
        "--lengths", nargs="+", type=int, required=True, help="context lengths in tokens, e.g. 2048 4096 8192"
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["none", "pi:2", "dynamic-ntk:2", "layerwise+pi:2", "layerwise+dynamic-ntk:2"],
        help="method specs as for sweep",
    )
    parser.add_argument("--windows", type=int, default=1, help="text windows scored per length")
    _common_model_options(parser)
    parser.set_defaults(func=_perplexity)


def _perplexity(args: argparse.Namespace) -> int:
    from rag_mspoe.eval.perplexity import PerplexityConfig, run_perplexity

    config = PerplexityConfig(
        text=str(Path(args.text).resolve()),
        lengths=tuple(args.lengths),
        methods=tuple(args.methods),
        windows=args.windows,
        model=args.model,
    )
    summary = run_perplexity(config, args.out, **model_load_options(args), progress=not args.no_progress)
    print(summary["markdown"])
    return 0


def _register_suite(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "suite",
        help="side effects per method: LongBench / ZeroSCROLLS long-context tasks, MMLU-style knowledge",
        description="Answer every example of the given task files with every method into OUT/results.jsonl, "
        "then write table.md and side_effects.md. Rerun the same command to resume.",
    )
    parser.add_argument("--out", required=True, help="run folder (an existing run is resumed)")
    for kind, what in (
        ("longbench", "LongBench-format JSONL (one task per file, e.g. hotpotqa.jsonl)"),
        ("zeroscrolls", "ZeroSCROLLS-format JSONL (validation split, e.g. qasper.jsonl)"),
        ("mmlu", "MMLU-format JSONL or CSV (question, choices, answer)"),
    ):
        parser.add_argument(
            f"--{kind}", nargs="+", default=[], metavar="FILE[:TASK]", help=f"{what}; :TASK names the task"
        )
    parser.add_argument("--methods", nargs="+", default=["none", "pi", "mspoe", "layerwise"])
    parser.add_argument(
        "--samples", type=int, default=None, help="first N examples of each task (default all)"
    )
    parser.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="prompt tokens before the middle is cut (default: the context window less the answer length)",
    )
    parser.add_argument(
        "--choice-scoring",
        choices=["letter", "text"],
        default="letter",
        help="MMLU: compare the answer letters (MMLU's way) or the choices' texts (kinder to small models)",
    )
    parser.add_argument("--batch-size", type=int, default=4, help="long-context prompts per generation batch")
    parser.add_argument("--sweep", default=None, help="a sweep folder, for the position-bias gain column")
    _common_model_options(parser)
    parser.set_defaults(func=_suite)


def data_files(args: argparse.Namespace) -> tuple[Any, ...]:
    from rag_mspoe.eval.suites.run import DataFile

    files = []
    for kind in ("longbench", "zeroscrolls", "mmlu"):
        for spec in getattr(args, kind):
            path, _, task = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
            files.append(DataFile(kind, str(Path(path).resolve()), task or None))
    return tuple(files)


def _suite(args: argparse.Namespace) -> int:
    from rag_mspoe.eval.suites.run import SuiteConfig, run_suite

    config = SuiteConfig(
        files=data_files(args),
        methods=tuple(args.methods),
        samples=args.samples,
        max_length=args.max_length,
        choice_scoring=args.choice_scoring,
        batch_size=args.batch_size,
        model=args.model,
    )
    sweep = Path(args.sweep) if args.sweep else None
    summary = run_suite(
        config, args.out, **model_load_options(args), progress=not args.no_progress, sweep=sweep
    )
    print(summary["markdown"])
    print(summary["side_effects"])
    return 0


def _register_suite_data(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "suite-data",
        help="write local task files in the LongBench, ZeroSCROLLS and MMLU formats (invented facts)",
    )
    parser.add_argument("--out", required=True, help="folder for the task files")
    parser.add_argument("--examples", type=int, default=20, help="examples per long-context task")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=_suite_data)


def _suite_data(args: argparse.Namespace) -> int:
    from rag_mspoe.eval.suites.data import write_suite_data

    files = write_suite_data(args.out, examples=args.examples, seed=args.seed)
    for path in files.values():
        print(path)
    longbench = " ".join(str(p) for kind, p in files.items() if kind.startswith("longbench"))
    print(
        f"\nrag-mspoe suite --longbench {longbench} --zeroscrolls {files['zeroscrolls']} "
        f"--mmlu {files['mmlu']} --out runs/side-effects"
    )
    return 0


def _register_build_qa(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "build-qa",
        help="multi-document QA examples from an NQ-open-style oracle file, distractors by our retriever",
        description="For each oracle record (question, answers, gold passage) take the passages of the "
        "pool that the FAISS + sentence-transformers retriever ranks highest for the question, minus "
        "those containing an answer, and write the example with the gold at --gold-at. Records with too "
        "few answer-free passages are skipped and counted. The output is a --data file for sweep.",
    )
    parser.add_argument("oracle", help="oracle records (.jsonl[.gz]): question, answers, gold passage")
    parser.add_argument(
        "--pool",
        nargs="+",
        required=True,
        help="passage files (.jsonl[.gz]): passages {title, text} or QA examples with ctxs (their "
        "answer-free, non-gold documents)",
    )
    parser.add_argument("--out", required=True, help="examples file to write (.jsonl or .jsonl.gz)")
    parser.add_argument("--documents", type=int, default=20, help="documents per example, gold included")
    parser.add_argument("--gold-at", type=int, default=0, help="gold position from 0 (sweeps move it)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N oracle records")
    parser.add_argument(
        "--index", default=None, help="folder to keep the pool's index in, so a rebuild skips the embedding"
    )
    parser.add_argument(
        "--embedding-model", default=None, help="sentence-transformers model (default: all-MiniLM-L6-v2)"
    )
    split = parser.add_argument_group("held-out split (by question, never by position)")
    split.add_argument("--heldout-out", default=None, help="also write held-out examples to this file")
    split.add_argument(
        "--heldout-fraction", type=float, default=0.5, help="share of the questions held out (default 0.5)"
    )
    split.add_argument("--split-seed", type=int, default=0, help="seed of the random split (default 0)")
    parser.set_defaults(func=_build_qa)


def _build_qa(args: argparse.Namespace) -> int:
    from rag_mspoe.eval.data.build_qa import (
        SkippedRecord,
        build_from_oracle,
        pool_from_records,
        split_by_question,
    )
    from rag_mspoe.eval.data.loaders import read_jsonl, save_jsonl
    from rag_mspoe.pipelines.embedding import DEFAULT_EMBEDDING_MODEL

    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {args.limit}.")
    if args.heldout_out and not 0 < args.heldout_fraction < 1:
        raise ValueError(f"--heldout-fraction must be between 0 and 1, got {args.heldout_fraction}.")
    records = read_jsonl(args.oracle)[: args.limit]
    pool = pool_from_records(record for path in args.pool for record in read_jsonl(path))
    skipped: list[SkippedRecord] = []
    examples = build_from_oracle(
        records,
        pool,
        args.documents,
        gold_index=args.gold_at,
        embedding_model=args.embedding_model or DEFAULT_EMBEDDING_MODEL,
        index_path=args.index,
        skipped=skipped,
    )
    print(
        f"{len(examples)} of {len(records)} records built ({args.documents} documents, gold at "
        f"{args.gold_at}, pool of {len(pool)} passages); {len(skipped)} skipped"
    )
    if args.heldout_out:
        examples, heldout = split_by_question(examples, args.heldout_fraction, args.split_seed)
        save_jsonl(args.heldout_out, heldout)
        print(f"{len(heldout)} held out into {args.heldout_out}")
    save_jsonl(args.out, examples)
    print(f"{len(examples)} into {args.out}")
    for record in skipped:
        print(f"  skipped {record.id}: {record.reason}")
    return 0


def _register_harness(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "harness",
        help="lm-evaluation-harness tasks (its zoo or local YAML) on the rescaled model, per method",
        description="Run lm-evaluation-harness tasks under each method into OUT (results.jsonl, "
        "manifest.json, table.md, summary.json); rerun to resume. Needs the harness extra.",
    )
    parser.add_argument("--tasks", nargs="+", required=True, help="harness task names or glob patterns")
    parser.add_argument("--include-path", default=None, help="folder of your own task YAML files")
    parser.add_argument("--methods", nargs="+", default=["none", "mspoe"], help="method specs as for sweep")
    parser.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    parser.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: task's)")
    parser.add_argument(
        "--batch-size", type=int, default=8, help="requests per forward (1 for per-prompt Ms-PoE)"
    )
    parser.add_argument("--out", required=True, help="run folder (an existing run is resumed)")
    _common_model_options(parser)
    parser.set_defaults(func=_harness)


def _harness(args: argparse.Namespace) -> int:
    from rag_mspoe.eval.harness import HarnessConfig, run_harness

    config = HarnessConfig(
        tasks=tuple(args.tasks),
        methods=tuple(args.methods),
        include_path=str(Path(args.include_path).resolve()) if args.include_path else None,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size,
        model=args.model,
    )
    summary = run_harness(config, args.out, **model_load_options(args), progress=not args.no_progress)
    print(summary["markdown"])
    return 0


def _register_e2e(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "e2e",
        help="end to end: questions through the real RAG pipeline, accuracy by retrieval rank and position",
    )
    parser.add_argument("questions", help="JSONL of {id, question, answers, gold_source} per line")
    parser.add_argument("corpus", nargs="+", help="files or folders to index (or an existing --index)")
    parser.add_argument("--out", required=True, help="run folder (an existing run is resumed)")
    parser.add_argument("--index", default=None, help="index folder (default: OUT/index)")
    parser.add_argument("--methods", nargs="+", default=["none", "mspoe", "longcontextreorder"])
    parser.add_argument("-k", type=int, default=10, help="chunks retrieved per question")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    _common_model_options(parser)
    parser.set_defaults(func=_e2e)


def _e2e(args: argparse.Namespace) -> int:
    from rag_mspoe.eval.e2e import E2EConfig, run_e2e

    config = E2EConfig(
        questions=str(Path(args.questions).resolve()),
        corpus=tuple(str(Path(p).resolve()) for p in args.corpus),
        methods=tuple(args.methods),
        k=args.k,
        max_new_tokens=args.max_new_tokens,
        model=args.model,
    )
    summary = run_e2e(
        config, args.out, index_dir=args.index, **model_load_options(args), progress=not args.no_progress
    )
    print(json.dumps(summary["overall"], indent=2))
    return 0
