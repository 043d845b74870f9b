"""Run a gold-position sweep into a folder: results.jsonl, manifest.json, then the report.

    config = SweepConfig(num_documents=10, positions=(0, 4, 9), methods=("none", "pi"), samples=100)
    run_sweep(config, "runs/qa10")

The run is resumable: restarted with the same settings it scores only what results.jsonl does
not hold yet, on the examples it saved on its first start (examples.jsonl.gz), so a killed run
loses at most the batch it was scoring and duplicates nothing. The manifest keeps the data
file's sha256: a resume with another file at its path is refused (`runs.inputs`).
Batches run in this process, on Ray workers (one model replica each) with `ray_address`, or
against an OpenAI-compatible server with `remote` (`eval.sweep.remote`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rag_mspoe.engine.remote_client import Endpoint
from rag_mspoe.eval.cli import parse_positions
from rag_mspoe.eval.method_engines import EngineSet
from rag_mspoe.eval.report import METRICS, TABLE_FILE, write_report
from rag_mspoe.eval.runs.loop import Evaluation, Pairing, run_evaluation
from rag_mspoe.eval.runs.results import RESULTS_FILE, SWEEP_KEY, Key
from rag_mspoe.eval.runs.units import Scorer
from rag_mspoe.eval.sweep.batch_scorer import BatchScorer
from rag_mspoe.eval.sweep.plan import Batch, Example, SweepConfig, load_examples, plan_batches
from rag_mspoe.eval.sweep.remote import RemoteEngines, RemoteRun, RemoteTarget, connect
from rag_mspoe.methods.method_spec import ResolvedMethod, resolve_all
from rag_mspoe.models.command_options import model_load_options
from rag_mspoe.models.loading import source_name

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
        if len(examples) == config.samples:
            return examples
        if len(examples) > config.samples:
            raise ValueError(
                f"{path} holds {len(examples)} examples, more than --samples {config.samples}; resume "
                f"with --samples {len(examples)} or more, or use a new folder (--out)."
            )
        # More questions: the run grows only if the ones it scored start the larger selection.
        grown = load_examples(config)
        if grown[: len(examples)] != examples:
            raise ValueError(
                f"The first {len(examples)} of the {config.samples} examples {config.data} gives now are not "
                f"the examples saved in {path}; the sweep cannot grow into them. Use a new folder (--out)."
            )
        loaders.save_jsonl(path, grown)
        return grown
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
    early_files = (EXAMPLES_FILE,)  # frozen by `plan`, before the manifest is written
    identity_fields = SweepConfig.IDENTITY
    config: SweepConfig
    methods: Sequence[ResolvedMethod]
    examples: list[Example] = field(default_factory=list)
    folder: Path | None = None  # set by plan: scorers look up records of the same prompt there
    remote: RemoteRun | None = None  # the model runs on an endpoint (config.endpoint)

    @classmethod
    def report(cls, folder: Path, options: argparse.Namespace) -> str:
        out = Path(options.out) if options.out else folder
        write_report(
            folder,
            metric=options.metric,
            baseline=options.baseline,
            methods=options.methods,
            out=out,
            leave_out=Path(options.leave_out) if options.leave_out else None,
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
            "--decode-batch",
            type=int,
            default=SweepConfig.decode_batch,
            help="answers decoded together for --metrics generate (each prompt is prefilled alone on "
            f"the CPU); speed only, the records are the same (default {SweepConfig.decode_batch})",
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
        remote = parser.add_argument_group(
            "remote endpoint",
            "score a model served elsewhere (vLLM, llama.cpp's server, rag-mspoe serve): --model is then "
            "the served model's name",
        )
        remote.add_argument(
            "--endpoint", default=None, metavar="URL", help="an OpenAI-compatible API's base URL (.../v1)"
        )
        remote.add_argument(
            "--api-key-env", default=None, metavar="VAR", help="environment variable holding the API key"
        )
        remote.add_argument(
            "--tokenizer",
            default=None,
            metavar="PATH_OR_NAME",
            help="the served model's tokenizer (folder, hub id or embedded model name): its chat template "
            "renders prompts for /v1/completions, which scores them; without it the server's chat "
            "endpoint renders them, for --metrics generate only",
        )
        remote.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
        remote.add_argument("--retries", type=int, default=4, help="further attempts of a failed request")
        remote.add_argument(
            "--max-requests",
            type=int,
            default=None,
            help="stop after this many requests (retries included); rerun the same command to go on",
        )
        parser.add_argument(
            "--budget-hours",
            type=float,
            default=None,
            help="stop starting batches after this many hours; rerun the same command to go on",
        )
        parser.add_argument(
            "--no-report",
            action="store_true",
            help="leave the folder's report (table.md, summary.json, the plot) as it was, e.g. when "
            "adding a label to a published run; `rag-mspoe report` writes one when wanted",
        )

    @classmethod
    def run_command(cls, args: argparse.Namespace) -> int:
        target = remote_target(args)
        if target is not None and args.ray is not None:
            raise ValueError("--endpoint runs the model on that server; drop --ray (use --concurrency).")
        outcome = run_sweep(
            sweep_config(args),
            args.out,
            remote=target,
            **({} if target else model_load_options(args)),
            ray_address=args.ray,
            ray_workers=args.ray_workers,
            progress=not args.no_progress,
            budget_hours=args.budget_hours,
            report=not args.no_report,
        )
        print(f"{outcome.total}/{outcome.expected} records in {outcome.folder} ({outcome.written} new)")
        table = "" if args.no_report else _table(outcome.folder)  # else the table would be an old one
        if table:
            print(table)
        return 0

    def inputs(self) -> Sequence[str]:
        return () if self.config.data is None else (self.config.data,)

    def raisable_settings(self) -> Sequence[str]:
        # A data file's first N questions start its first N + k; a generator's draws may not.
        return () if self.config.data is None else ("samples",)

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

    def remote_scorer(self) -> tuple[Scorer, dict[str, Any]] | None:
        if self.remote is None:
            return None
        results = None if self.folder is None else self.folder / RESULTS_FILE
        engines = RemoteEngines(self.remote.engine)
        scorer = BatchScorer(self.config, self.examples, self.methods, engines, results).score
        return self.remote.scorer(scorer), self.remote.facts()

    def expected(self) -> set[Key]:
        return {
            (m.name, p, ex.id) for m in self.methods for p in self.config.positions for ex in self.examples
        }


def run_sweep(
    config: SweepConfig,
    folder: str | Path,
    *,
    report: bool = True,
    remote: RemoteTarget | None = None,
    **options: Any,
) -> SweepOutcome:
    """Score every pending (method, position, example) of `config` into `folder`.

    remote: the endpoint whose model scores (`eval.sweep.remote`); config.model is then the served
    model's name. options: those of `run_evaluation` (model, tokenizer, threads, device, dtype,
    ray_address, ray_workers, progress, budget_hours).
    """
    methods = resolve_all(config.methods, source_name(config.model))
    if remote is not None:
        config = dataclasses.replace(config, endpoint=remote.endpoint.base, template=remote.template)
    elif config.endpoint is not None:
        raise ValueError(f"This sweep's model runs at {config.endpoint}; pass remote= to reach it.")
    connected = None if remote is None else connect(remote, methods, config.metrics)
    sweep = Sweep(config, methods, remote=connected)
    try:
        outcome = run_evaluation(sweep, folder, **options)
    finally:
        if connected is not None:
            connected.engine.client.close()
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
        decode_batch=args.decode_batch,
        model=args.model,
    )


def remote_target(args: argparse.Namespace) -> RemoteTarget | None:
    """The endpoint the options name, or None for a local model."""
    if args.endpoint is None:
        return None
    if not args.model:
        raise ValueError("--endpoint needs --model NAME: the model's name on that server (its /v1/models).")
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise ValueError(f"--api-key-env {args.api_key_env}: that environment variable is not set.")
    endpoint = Endpoint(
        args.endpoint,
        args.model,
        api_key=api_key,
        concurrency=args.concurrency,
        retries=args.retries,
        max_requests=args.max_requests,
    )
    return RemoteTarget(endpoint, args.tokenizer)


def _table(folder: Path) -> str:
    """The report's Markdown table, if it was written."""
    table = folder / TABLE_FILE
    return table.read_text() if table.is_file() else ""
