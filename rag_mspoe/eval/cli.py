"""The evaluation commands: one per evaluation kind (sweep, perplexity, e2e, harness, suite), and
`report`, `compare`, `suite-data` and `build-qa`.

    rag-mspoe sweep --documents 10 --positions 0,4,9 --methods none pi mspoe --samples 100 --out runs/qa10
    rag-mspoe report runs/qa10
    rag-mspoe compare runs/qa10 runs/qa10-calibrated --out runs/qa10-vs-calibrated
    rag-mspoe perplexity book.txt --lengths 2048 4096 --methods none pi dynamic-ntk --out runs/ppl
    rag-mspoe e2e questions.jsonl corpus/ --methods none mspoe longcontextreorder --out runs/e2e
    rag-mspoe harness --tasks arc_easy --methods none mspoe --limit 200 --out runs/harness
    rag-mspoe suite-data --out data/local
    rag-mspoe build-qa nq-open-oracle.jsonl.gz --pool passages.jsonl --documents 20 --out data/nq20.jsonl.gz
    rag-mspoe suite --longbench hotpotqa.jsonl --mmlu mmlu.jsonl --sweep runs/qa10 --out runs/side

A kind's command (its help, options and what runs it) is declared on its `Evaluation` subclass;
this module adds the command of every registered kind, the commands that are not a kind, and the
options the commands share. Every command writes into its --out folder and resumes from what it
finds there. Heavy libraries are imported only when a command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rag_mspoe.eval.runs.loop import Evaluation, folder_kind
from rag_mspoe.models.command_options import add_model_options


def register(subparsers: Any) -> None:
    # Importing this module imported rag_mspoe.eval, which imports every kind's module: the
    # registry holds them all. Sorted, so the order of --help never hangs on the order of imports.
    for kind in sorted(Evaluation.registry):
        _register_kind(subparsers, Evaluation.registry[kind])
    _register_report(subparsers)
    _register_compare(subparsers)
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


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The model options and --no-progress, for every command that runs an evaluation."""
    add_model_options(parser)
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _register_kind(subparsers: Any, evaluation: type[Evaluation]) -> None:
    """`rag-mspoe <kind>`: the kind's own options, then those every evaluation's command has."""
    parser = subparsers.add_parser(
        evaluation.kind, help=evaluation.command_help, description=evaluation.command_description
    )
    evaluation.add_options(parser)
    add_run_options(parser)
    parser.set_defaults(func=evaluation.run_command)


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
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        metavar="LABEL",
        help="for a sweep folder: report only these labels, on the examples they all have; "
        "LABEL=NAME shows a label as NAME (--baseline then takes the name shown)",
    )
    parser.add_argument(
        "--out", default=None, help="for a sweep folder: write the report here instead of into the run folder"
    )
    parser.add_argument(
        "--leave-out",
        default=None,
        metavar="FILE",
        help="for a sweep folder: leave out the examples whose ids FILE lists, one per line "
        "(e.g. the questions a choice was made on)",
    )
    parser.set_defaults(func=_report)


def _report(args: argparse.Namespace) -> int:
    """Rewrite the report of any run folder, of the kind its manifest names."""
    folder = Path(args.run)
    kind = folder_kind(folder)
    if kind != "sweep" and (args.methods or args.out or args.leave_out):
        raise ValueError(f"--methods, --out and --leave-out are for sweep folders; {folder} is a {kind} run.")
    print(Evaluation.registry[kind].report(folder, args))
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
