"""Run a gold-position sweep into a folder: results.jsonl, manifest.json, then the report.

    config = SweepConfig(num_documents=10, positions=(0, 4, 9), methods=("none", "pi"), samples=100)
    run_sweep(config, "runs/qa10")

The run is resumable: restarted with the same settings it scores only what results.jsonl does
not hold yet, on the examples it saved on its first start (examples.jsonl.gz), so a killed run
loses at most the batch it was scoring and duplicates nothing.
Batches run in this process, or on Ray workers (one model replica each) with `ray_address`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rag_mspoe.eval.manifest import finish_session, model_facts, start_session, write_manifest
from rag_mspoe.eval.registry import EngineSet, EvalMethod, resolve_all
from rag_mspoe.eval.results import ResultsFile, run_lock
from rag_mspoe.eval.scorer import BatchScorer
from rag_mspoe.eval.sweep import Batch, Example, SweepConfig, load_examples, plan_batches
from rag_mspoe.progress import progress_bar

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
    from rag_mspoe.eval import loaders

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


def pending_batches(
    config: SweepConfig, examples: Sequence[Example], done: set[tuple[str, int, str]]
) -> list[Batch]:
    """The sweep's batches less the items already written (a resumed run skips them)."""
    pending = []
    names = [method.name for method in resolve_all(config.methods)]  # "cal=path.json" is named "cal"
    for batch in plan_batches(len(examples), names, config.positions, config.batch_size):
        items = tuple(
            (position, index)
            for position, index in batch.items
            if (batch.method, position, examples[index].id) not in done
        )
        if items:
            pending.append(Batch(batch.method, items))
    return pending


def run_sweep(
    config: SweepConfig,
    folder: str | Path,
    *,
    model: Any = None,
    tokenizer: Any = None,
    threads: int | None = None,
    device: str | None = "auto",
    dtype: str | None = None,
    ray_address: str | None = None,
    ray_workers: int = 2,
    progress: bool | None = None,
    report: bool = True,
) -> SweepOutcome:
    """Score every pending (method, position, example) of `config` into `folder`.

    model/tokenizer: an already loaded model (else `config.model` is loaded; never with Ray,
    whose workers load their own). ray_address: "local" for a Ray instance on this machine,
    or the address of a running cluster.
    """
    out = Path(folder)
    methods = resolve_all(config.methods)
    with run_lock(out):
        manifest = start_session(out, config, methods)
        examples = frozen_examples(config, out)
        write_manifest(out, manifest)
        results = ResultsFile(out)
        expected = len(methods) * len(config.positions) * len(examples)
        done_here = sum(
            1
            for m in methods
            for p in config.positions
            for ex in examples
            if (m.name, p, ex.id) in results.done
        )
        batches = pending_batches(config, examples, results.done)
        bar = progress_bar(
            total=expected,
            initial=done_here,
            unit="ex",
            desc=f"sweep {out.name}",
            progress=progress,
        )
        written = 0
        facts: dict[str, Any] = {}
        stream: Iterator[list[dict[str, Any]]] = iter(())
        try:
            if ray_address is not None:
                from rag_mspoe.eval.ray_backend import score_on_ray

                stream, facts = score_on_ray(
                    config, examples, batches, ray_address, ray_workers, threads, device, dtype
                )
            else:
                stream, facts = _score_locally(
                    config, examples, methods, batches, model, tokenizer, threads, device, dtype
                )
            if facts:  # a report of a run still going can name its model
                manifest["model"] = facts
                write_manifest(out, manifest)
            for records in stream:
                written += results.append(records)
                bar.update(len(records))
        finally:
            getattr(stream, "close", lambda: None)()  # stops Ray workers when the run is interrupted
            bar.close()
            complete = done_here + written >= expected
            finish_session(manifest, facts or manifest.get("model", {}), len(results.done), complete)
            write_manifest(out, manifest)
    if report:
        from rag_mspoe.eval.report import write_report

        write_report(out)
    return SweepOutcome(out, written, done_here + written, expected)


def _score_locally(
    config: SweepConfig,
    examples: Sequence[Example],
    methods: Sequence[EvalMethod],
    batches: Sequence[Batch],
    model: Any,
    tokenizer: Any,
    threads: int | None,
    device: str | None,
    dtype: str | None,
) -> tuple[Iterator[list[dict[str, Any]]], dict[str, Any]]:
    if model is None:
        if not batches:
            return iter(()), {}
        from rag_mspoe import load_model

        model, tokenizer = load_model(config.model, device=device, dtype=dtype, threads=threads)
    scorer = BatchScorer(config, examples, methods, EngineSet(model, tokenizer))
    return (scorer.score(batch) for batch in batches), model_facts(model)
