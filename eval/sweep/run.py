"""Run a gold-position sweep into a folder: results.jsonl, manifest.json, then the report.

    config = SweepConfig(num_documents=10, positions=(0, 4, 9), methods=("none", "pi"), samples=100)
    run_sweep(config, "runs/qa10")

The run is resumable: restarted with the same settings it scores only what results.jsonl does
not hold yet, on the examples it saved on its first start (examples.jsonl.gz), so a killed run
loses at most the batch it was scoring and duplicates nothing.
Batches run in this process, or on Ray workers (one model replica each) with `ray_address`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rag_mspoe.eval.method_engines import EngineSet
from rag_mspoe.eval.report import METRICS, TABLE_FILE, write_report
from rag_mspoe.eval.runs.loop import Evaluation, Pairing, run_evaluation
from rag_mspoe.eval.runs.results import SWEEP_KEY, Key
from rag_mspoe.eval.runs.units import Scorer
from rag_mspoe.eval.sweep.batch_scorer import BatchScorer
from rag_mspoe.eval.sweep.plan import Batch, Example, SweepConfig, load_examples, plan_batches
from rag_mspoe.loading import source_name
from rag_mspoe.method_spec import ResolvedMethod, resolve_all

EXAMPLES_FILE = "examples.jsonl.gz"


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
    so a resumed run scores the very same examples even if a generator or data file changed."""
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
    pairing = Pairing("position", ("example_id",), METRICS)
    key_fields = SWEEP_KEY
    growing = ("methods", "positions")
    identity_fields = SweepConfig.IDENTITY
    config: SweepConfig
    methods: Sequence[ResolvedMethod]
    examples: list[Example] = field(default_factory=list)

    @classmethod
    def report(cls, folder: Path, options: argparse.Namespace) -> str:
        write_report(folder, metric=options.metric, baseline=options.baseline)
        table = folder / TABLE_FILE
        return table.read_text() if table.is_file() else ""

    def plan(self, folder: Path, done: set[Key]) -> list[Batch]:
        self.examples = examples = frozen_examples(self.config, folder)
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

    def scorer(self, model: Any, tokenizer: Any) -> Scorer:
        return BatchScorer(self.config, self.examples, self.methods, EngineSet(model, tokenizer)).score

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
