"""The one run loop of every evaluation kind: sweep, suite, harness, perplexity and e2e.

A kind is an `Evaluation`: its settings (those that must match to resume, and those that may
grow), its resolved methods, its pending units of work (`plan`), and how a unit becomes
records (`scorer`). `run_evaluation` does the rest the same way for all of them: it locks the
folder, refuses a run the manifest says it cannot resume (another kind, other settings, changed
input files, a method label bound to another config), skips what results.jsonl holds, loads the
model only if a unit is left (Ray workers load their own), appends each unit's records as it
completes and records the session. A run killed at any point loses at most the units it was
scoring and duplicates nothing. Methods arrive resolved (each runner resolves its specs once)
and travel so to Ray workers.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from rag_mspoe.eval.runs.heap import releasing
from rag_mspoe.eval.runs.inputs import (
    input_digests,
    refuse_changed_inputs,
    relative_to,
    take_moved_inputs,
    unrecorded_inputs,
    where,
)
from rag_mspoe.eval.runs.manifest import (
    MANIFEST_FILE,
    claim_run_folder,
    finish_session,
    jsonable,
    model_facts,
    new_session,
    read_manifest,
    record_methods,
    refuse_other_settings,
    write_manifest,
)
from rag_mspoe.eval.runs.ray_backend import score_on_ray
from rag_mspoe.eval.runs.results import RESULTS_FILE, Key, ResultsFile, run_lock
from rag_mspoe.eval.runs.units import Scorer
from rag_mspoe.methods.method_spec import ResolvedMethod
from rag_mspoe.progress import progress_bar

# What a kind declares for its `rag-mspoe <kind>` command.
_COMMAND = ("command_help", "add_options", "run_command")


class RunStopped(Exception):
    """A scorer cannot go on (a remote run's request budget is spent): the run stops as at the end
    of its --budget-hours, with what it scored kept, and a rerun goes on from there."""


@dataclass(frozen=True)
class Pairing:
    """How two runs of one kind line up: rows per (method, group), pairs by item, these metrics."""

    group: str | None  # a record field (None: one row per method)
    item: tuple[str, ...]  # the record fields naming what is scored in both runs
    metrics: tuple[str, ...]  # in order of preference; 0/1 ones are shown in %


class Evaluation:
    """One evaluation kind, as the run loop, its command, `report` and `compare` see it
    (subclasses are picklable dataclasses). A kind is one subclass; defining it registers it by
    `kind` (rag_mspoe.eval imports every kind's module, so each is known wherever the evaluation
    is, and `rag-mspoe` offers its command)."""

    registry: ClassVar[dict[str, type[Evaluation]]] = {}
    kind: ClassVar[str]  # the manifest section that names and describes the run
    pairing: ClassVar[Pairing]  # how `compare` lines two runs of this kind up
    key_fields: ClassVar[tuple[str, ...]]  # what makes a record unique in results.jsonl
    identity_fields: ClassVar[tuple[str, ...]]  # settings the records depend on: kept on resume
    growing: ClassVar[tuple[str, ...]] = ("methods",)  # settings a resumed run may extend
    # Files `plan` may write before the first manifest: what a first run killed in between leaves.
    early_files: ClassVar[tuple[str, ...]] = ()
    unit_name: ClassVar[str] = "batch"  # what the progress bar counts
    command_help: ClassVar[str]  # the line `rag-mspoe --help` gives the kind's command
    command_description: ClassVar[str | None] = None  # what `rag-mspoe <kind> --help` says first
    config: Any  # the kind's settings; `config.model` is the model to load
    methods: Sequence[ResolvedMethod]

    def settings(self) -> dict[str, Any]:
        """Everything the manifest keeps about the run."""
        return jsonable(dataclasses.asdict(self.config))

    def inputs(self) -> Sequence[str]:
        """Files the records depend on: a resumed run refuses them changed (`runs.inputs`)."""
        return ()

    def raisable_settings(self) -> Sequence[str]:
        """Counts among `identity_fields` that a resumed run may raise (more questions), because
        the kind checks that what the run holds is the start of the larger run (`plan`)."""
        return ()

    def check_unrecorded_inputs(self, folder: Path) -> None:
        """Before the digests of `inputs()` are recorded in a run started by a version that did not
        record them: raise ValueError if what the run saved shows they changed since."""

    def plan(self, folder: Path, done: set[Key]) -> list[Any]:
        """The units of work whose records are not in `done`."""
        raise NotImplementedError

    def shared_work(self, unit: Any) -> Hashable | None:
        """What `unit` shares with other units that a worker keeps in its caches (None: nothing);
        with Ray, a worker is given the units that share its earlier ones."""
        return None

    def prepare(self) -> None:
        """Work before the model loads, run only when units are pending (fail early, build an index)."""

    def scorer(self, model: Any, tokenizer: Any) -> Scorer:
        """unit -> its records, with this model."""
        raise NotImplementedError

    def remote_scorer(self) -> tuple[Scorer, dict[str, Any]] | None:
        """A scorer whose model runs elsewhere (an OpenAI-compatible endpoint), and what the manifest
        records of that model; None: the run loads the model."""
        return None

    @classmethod
    def report(cls, folder: Path, options: argparse.Namespace) -> str:
        """Write the summary of a run folder of this kind; returns what `report` prints.

        options: those of the `report` command (metric, baseline, sweep)."""
        raise NotImplementedError

    @classmethod
    def add_options(cls, parser: argparse.ArgumentParser) -> None:
        """The options of `rag-mspoe <kind>` but those every kind's command has (the model
        options and --no-progress: `rag_mspoe.eval.cli` adds those, and the command)."""
        raise NotImplementedError

    @classmethod
    def run_command(cls, args: argparse.Namespace) -> int:
        """Run `rag-mspoe <kind>` with its parsed options; returns the exit status."""
        raise NotImplementedError

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            # Checked here: a kind without its command would break every `rag-mspoe` command.
            own = cls.__mro__[: cls.__mro__.index(Evaluation)]
            missing = [name for name in _COMMAND if not any(name in klass.__dict__ for klass in own)]
            if missing:
                raise TypeError(
                    f"{cls.__name__} (kind {cls.kind!r}) has no {', '.join(missing)}: every kind declares "
                    f"its `rag-mspoe {cls.kind}` command (see Evaluation)."
                )
            Evaluation.registry[cls.kind] = cls


@dataclass(frozen=True)
class RunOutcome:
    folder: Path
    written: int  # records written by this call
    done: frozenset[Key]  # keys of every record in the folder now


def run_kind(manifest: dict[str, Any]) -> str | None:
    """Which kind of run a manifest describes."""
    return next((kind for kind in Evaluation.registry if manifest.get(kind) is not None), None)


def folder_kind(folder: Path) -> str:
    """Which kind of run a folder holds; a bare results file is a sweep's."""
    return run_kind(read_manifest(folder) or {}) or "sweep"


def run_evaluation(
    evaluation: Evaluation,
    folder: str | Path,
    *,
    model: Any = None,
    tokenizer: Any = None,
    threads: int | None = None,
    device: str | None = "auto",
    dtype: str | None = None,
    quantize: str | None = None,
    ray_address: str | None = None,
    ray_workers: int = 2,
    progress: bool | None = None,
    budget_hours: float | None = None,
) -> RunOutcome:
    """Score every pending unit of `evaluation` into `folder` (see the module docstring).

    model/tokenizer: an already loaded model (else `config.model` is loaded, with threads, device,
    dtype and quantize as `load_model` takes them; never with Ray, whose workers load their own).
    ray_address: "local" or a cluster address. budget_hours: start no unit after this much time
    (model loading included); a rerun goes on from there.
    """
    if ray_address is not None and ray_workers < 1:
        raise ValueError(f"--ray-workers must be at least 1, got {ray_workers}.")
    if budget_hours is not None and not budget_hours > 0:
        raise ValueError(f"--budget-hours must be a positive number of hours, got {budget_hours}.")
    deadline = None if budget_hours is None else time.monotonic() + budget_hours * 3600
    out = Path(folder)
    claim_run_folder(out, evaluation.early_files)
    with run_lock(out):
        manifest, first_recorded = _checked_manifest(out, evaluation)
        results = ResultsFile(out / RESULTS_FILE, evaluation.key_fields)
        units = evaluation.plan(out, results.done)
        manifest["sessions"].append(new_session(host_cpus=os.cpu_count()))
        write_manifest(out, manifest)
        for file in first_recorded:
            print(
                f"{out} recorded no digest of {file}, the version that started it did not keep one; "
                "recorded now, so a resume with another file there is refused.",
                file=sys.stderr,
            )
        bar = progress_bar(
            total=len(units),
            unit=evaluation.unit_name,
            desc=f"{evaluation.kind} {out.name}",
            progress=progress,
        )
        written = scored = 0
        stream: Iterator[list[dict[str, Any]]] = iter(())
        try:
            if units:
                evaluation.prepare()
                remote = evaluation.remote_scorer()
                if remote is not None:
                    if ray_address is not None:
                        raise ValueError("A run against an endpoint fans out there; drop --ray.")
                    score, facts = remote
                    stream = (score(unit) for unit in units)
                elif ray_address is not None:
                    stream, facts = score_on_ray(
                        evaluation,
                        units,
                        ray_address,
                        ray_workers,
                        threads,
                        device,
                        dtype,
                        quantize,
                        shared_work=evaluation.shared_work,
                    )
                else:
                    stream, facts = _score_here(
                        evaluation, units, model, tokenizer, threads, device, dtype, quantize
                    )
                manifest["model"] = facts  # a report of a run still going can name its model
                write_manifest(out, manifest)
            try:
                for records in stream:
                    written += results.append(records)
                    scored += 1
                    bar.update(1)
                    if deadline is not None and time.monotonic() > deadline and scored < len(units):
                        raise RunStopped(f"Budget of {budget_hours} h spent.")
            except RunStopped as stopped:
                print(f"{stopped} {len(units) - scored} units left for a rerun.", file=sys.stderr)
        finally:
            getattr(stream, "close", lambda: None)()  # stops Ray workers when the run is interrupted
            bar.close()
            finish_session(manifest, len(results.done), scored == len(units))
            write_manifest(out, manifest)
    return RunOutcome(out, written, frozenset(results.done))


def _checked_manifest(folder: Path, evaluation: Evaluation) -> tuple[dict[str, Any], list[str]]:
    """The folder's manifest updated for this session, after refusing a run it cannot resume; and
    the input files whose digests it records for the first time (`inputs.unrecorded_inputs`)."""
    kind = evaluation.kind
    digests = input_digests(folder, evaluation.inputs())
    settings = relative_to(folder, evaluation.settings())
    manifest = read_manifest(folder)
    unrecorded: list[str] = []
    if manifest is None:  # a new run: `claim_run_folder` refused records without their manifest
        manifest = {"methods": {}, "sessions": []}
    else:
        found = run_kind(manifest)
        if found is None:
            raise ValueError(
                f"{folder / MANIFEST_FILE} is not a run's manifest (it names none of the kinds "
                f"{', '.join(sorted(Evaluation.registry))}); restore it, or write into a new folder (--out)."
            )
        if found != kind:
            raise ValueError(
                f"{folder} holds a {found} run, not a {kind} run; write into a new folder (--out)."
            )
        identity = {name: settings[name] for name in evaluation.identity_fields}
        previous = relative_to(folder, manifest.get(kind) or {})  # older runs kept absolute paths
        known = relative_to(folder, manifest.get("data") or {})
        refuse_changed_inputs(folder, digests, known)
        take_moved_inputs(identity, previous, digests, known)
        for name in evaluation.raisable_settings():
            if isinstance(previous.get(name), int) and identity[name] >= previous[name]:
                previous = {**previous, name: identity[name]}
        refuse_other_settings(
            folder, f"a {kind} run with other settings", previous, identity, {**known, **digests}
        )
        unrecorded = unrecorded_inputs(digests, known)
        if unrecorded:
            evaluation.check_unrecorded_inputs(folder)
    record_methods(manifest, list(evaluation.methods), folder)
    for name in evaluation.growing:
        settings[name] = list(dict.fromkeys([*(manifest.get(kind) or {}).get(name, []), *settings[name]]))
    manifest[kind] = settings
    if digests:
        manifest["data"] = digests
    return manifest, [f"{where(folder, path)} (sha256 {digests[path]})" for path in unrecorded]


def _score_here(
    evaluation: Evaluation,
    units: Sequence[Any],
    model: Any,
    tokenizer: Any,
    threads: int | None,
    device: str | None,
    dtype: str | None,
    quantize: str | None,
) -> tuple[Iterator[list[dict[str, Any]]], dict[str, Any]]:
    if model is None:
        from rag_mspoe import load_model

        model, tokenizer = load_model(
            evaluation.config.model, device=device, dtype=dtype, threads=threads, quantize=quantize
        )
    score = releasing(evaluation.scorer(model, tokenizer))
    return (score(unit) for unit in units), model_facts(model)
