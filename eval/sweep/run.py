"""Run a gold-position sweep into a folder: results.jsonl, manifest.json, then the report.

    config = SweepConfig(num_documents=10, positions=(0, 4, 9), methods=("none", "pi"), samples=100)
    run_sweep(config, "runs/qa10")

The run is resumable: restarted with the same settings it scores only what results.jsonl does
not hold yet, on the examples it saved on its first start (examples.jsonl.gz), so a killed run
loses at most the batch it was scoring and duplicates nothing. The manifest keeps the data
file's sha256: a resume with another file at its path is refused (`runs.inputs`).
Batches run in this process, or on Ray workers (one model replica each) with `ray_address`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rag_mspoe.cli import model_load_options
from rag_mspoe.eval.cli import parse_positions
from rag_mspoe.eval.method_engines import EngineSet
from rag_mspoe.eval.report import METRICS, TABLE_FILE, write_report
from rag_mspoe.eval.runs.loop import Evaluation, Pairing, run_evaluation
from rag_mspoe.eval.runs.results import RESULTS_FILE, SWEEP_KEY, Key
from rag_mspoe.eval.runs.units import Scorer
from rag_mspoe.eval.sweep.batch_scorer import BatchScorer
from rag_mspoe.eval.sweep.plan import Batch, Example, SweepConfig, load_examples, plan_batches
from rag_mspoe.loading import source_name
from rag_mspoe.method_spec import ResolvedMethod, resolve_all

EXAMPLES_FILE = "examples.jsonl.gz"
DEFAULT_METHODS = ["none", "pi", "mspoe", "layerwise", "longcontextreorder"]


@dataclass(frozen=True)
class SweepOutcome:
    folder: Path
    written: int  # records written by this call
    total: int  # records the sweep has in all
    expected: int  # records a complete sweep has

    @property
    def complete(self) -> bool:
        return self.total >= self.expected


def frozen_examples(config: SweepConfig, folder: Path) -> list[Example]:
    """The run's examples, saved in the folder on its first start and read back on every resume,
    so a resumed run scores the very same examples even if the generator's code changed (another
    data file at the data's path is refused before: `runs.inputs`)."""
    from rag_mspoe.eval.data import loaders

    path = folder / EXAMPLES_FILE
    if path.is_file():
        examples: list[Example] = list((loaders.load_qa if config.task == "qa" else loaders.load_kv)(path))
        if len(examples) != config.samples:
            raise ValueError(
                f"{path} holds {len(examples)} examples, not {config.samples}; use a new folder."
            )
        return examples
    examples = load_examples(config)
    loaders.save_jsonl(path, examples)
    return examples


@dataclass
class Sweep(Evaluation):
    """A sweep as the run loop sees it: units are batches of one method; examples frozen in the folder."""

    kind = "sweep"
    command_help = "gold-position sweep: every method at every gold position on the same examples"
    command_description = (
        "Score each (method, gold position, example) into OUT/results.jsonl, then write the report. "
        "Rerun the same command to resume a stopped run."
    )
    pairing = Pairing("position", ("example_id",), METRICS)
    key_fields = SWEEP_KEY
    growing = ("methods", "positions")
    identity_fields = SweepConfig.IDENTITY
    config: SweepConfig
    methods: Sequence[ResolvedMethod]
    examples: list[Example] = field(default_factory=list)
    folder: Path | None = None  # set by plan: scorers look up records of the same prompt there

    @classmethod
    def report(cls, folder: Path, options: argparse.Namespace) -> str:
        out = Path(options.out) if options.out else folder
        write_report(
            folder,
            metric=options.metric,
            baseline=options.baseline,
            methods=options.methods,
            out=out,
        )
        return _table(out)

    @classmethod
    def add_options(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--out", required=True, help="run folder (created; an existing run is resumed)")
        parser.add_argument(
            "--task", choices=["qa", "kv"], default="qa", help="multi-document QA or key-value"
        )
        source = parser.add_mutually_exclusive_group()
        source.add_argument("--data", default=None, help="examples file (.jsonl or .jsonl.gz, paper format)")
        source.add_argument(
            "--generator",
            choices=["invented-qa", "kv", "kv-short"],
            default=None,
            help="draw examples instead (default: invented-qa for qa, kv for kv)",
        )
        parser.add_argument(
            "--documents", type=int, default=10, help="documents (QA) or pairs (KV) per prompt"
        )
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
        parser.add_argument(
            "--similarity", type=float, default=0.5, help="distractor similarity (invented-qa)"
        )
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

    @classmethod
    def run_command(cls, args: argparse.Namespace) -> int:
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
        table = _table(outcome.folder)
        if table:
            print(table)
        return 0

    def inputs(self) -> Sequence[str]:
        return () if self.config.data is None else (self.config.data,)

    def check_unrecorded_inputs(self, folder: Path) -> None:
        # A sweep from before input digests: its saved examples show whether the data changed.
        saved = folder / EXAMPLES_FILE
        if self.config.data is None or not saved.is_file():
            return
        if frozen_examples(self.config, folder) != load_examples(self.config):
            raise ValueError(
                f"{self.config.data} no longer holds the examples this sweep saved in {saved} when it "
                f"started: the file changed since. Restore the file the sweep in {folder} started with "
                "to resume it, or write into a new folder (--out) to run on this one."
            )

    def plan(self, folder: Path, done: set[Key]) -> list[Batch]:
        self.examples = examples = frozen_examples(self.config, folder)
        self.folder = folder.resolve()
        names = [m.name for m in self.methods]
        pending = []
        for batch in plan_batches(len(examples), names, self.config.positions, self.config.batch_size):
            items = tuple(
                (position, index)
                for position, index in batch.items
                if (batch.method, position, examples[index].id) not in done
            )
            if items:
                pending.append(Batch(batch.method, items))
        return pending

    def shared_work(self, unit: Batch) -> frozenset[int]:
        # A batch's examples: every label reads their documents, whose caches (the unmodified
        # model's rows, a reordering's scores) stay in the worker that read them first.
        return unit.examples

    def scorer(self, model: Any, tokenizer: Any) -> Scorer:
        results = None if self.folder is None else self.folder / RESULTS_FILE
        engines = EngineSet(model, tokenizer)
        return BatchScorer(self.config, self.examples, self.methods, engines, results).score

    def expected(self) -> set[Key]:
        return {
            (m.name, p, ex.id) for m in self.methods for p in self.config.positions for ex in self.examples
        }


def run_sweep(
    config: SweepConfig,
    folder: str | Path,
    *,
    report: bool = True,
    **options: Any,
) -> SweepOutcome:
    """Score every pending (method, position, example) of `config` into `folder`.

    options: those of `run_evaluation` (model, tokenizer, threads, device, dtype, ray_address,
    ray_workers, progress).
    """
    sweep = Sweep(config, resolve_all(config.methods, source_name(config.model)))
    outcome = run_evaluation(sweep, folder, **options)
    if report:
        write_report(outcome.folder)
    expected = sweep.expected()
    return SweepOutcome(outcome.folder, outcome.written, len(expected & outcome.done), len(expected))


def sweep_config(args: argparse.Namespace) -> SweepConfig:
    """The settings the options of `rag-mspoe sweep` give."""
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


def _table(folder: Path) -> str:
    """The report's Markdown table, if it was written."""
    table = folder / TABLE_FILE
    return table.read_text() if table.is_file() else ""
