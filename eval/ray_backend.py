"""Fan a sweep's batches out over Ray workers, each holding one model replica.

Workers only score; the driver writes every record, so results.jsonl has one writer and the
once-only guarantee of a local run holds. Each worker is kept two batches busy, so it never
waits for the driver between batches.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

from rag_mspoe.eval.sweep import Batch, Example, SweepConfig

RAY_INSTALL = "pip install 'rag-mspoe[ray]'"
_IN_FLIGHT_PER_WORKER = 2


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError(f"--ray needs the ray package; install it with: {RAY_INSTALL}") from None
    return ray


class SweepWorker:
    """One model replica scoring batches (the body of a Ray actor)."""

    def __init__(
        self,
        config: SweepConfig,
        examples: Sequence[Example],
        threads: int | None,
        device: str | None = "auto",
        dtype: str | None = None,
    ) -> None:
        from rag_mspoe import load_model
        from rag_mspoe.eval.manifest import model_facts
        from rag_mspoe.eval.registry import EngineSet, resolve_all
        from rag_mspoe.eval.scorer import BatchScorer

        model, tokenizer = load_model(config.model, device=device, dtype=dtype, threads=threads or 1)
        self.facts = model_facts(model)
        self.scorer = BatchScorer(config, examples, resolve_all(config.methods), EngineSet(model, tokenizer))

    def model_facts(self) -> dict[str, Any]:
        return self.facts

    def score(self, batch: Batch) -> list[dict[str, Any]]:
        return self.scorer.score(batch)


def connect(address: str, workers: int) -> bool:
    """Join a cluster (an address) or start a local Ray with one CPU per worker; True if started here."""
    ray = _import_ray()
    if ray.is_initialized():
        return False
    if address == "local":
        # Ray starts its workers at nice 15; on a busy machine they would then wait behind every
        # other process (measured: a 4 s import took 50 s), though they do all of the sweep's work.
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)
    return True


def score_on_ray(
    config: SweepConfig,
    examples: Sequence[Example],
    batches: Sequence[Batch],
    address: str,
    workers: int,
    threads: int | None,
    device: str | None = "auto",
    dtype: str | None = None,
) -> tuple[Iterator[list[dict[str, Any]]], dict[str, Any]]:
    """Start `workers` replicas and return (records of each batch as it completes, model facts)."""
    if workers < 1:
        raise ValueError(f"--ray-workers must be at least 1, got {workers}.")
    if not batches:
        return iter(()), {}
    ray = _import_ray()
    started_here = connect(address, workers)
    actor = ray.remote(num_cpus=1)(SweepWorker)
    replicas = [
        actor.remote(config, list(examples), threads, device, dtype)
        for _ in range(min(workers, len(batches)))
    ]
    try:
        facts = ray.get(replicas[0].model_facts.remote())
    except BaseException:
        _release(ray, replicas, started_here)
        raise
    return _stream(ray, replicas, batches, started_here), facts


def _stream(
    ray: Any, replicas: list[Any], batches: Sequence[Batch], started_here: bool
) -> Iterator[list[dict[str, Any]]]:
    queue = list(batches)[::-1]
    running: dict[Any, Any] = {}  # object ref -> replica scoring it

    def submit(replica: Any) -> None:
        if queue:
            running[replica.score.remote(queue.pop())] = replica

    try:
        for replica in replicas:
            for _ in range(_IN_FLIGHT_PER_WORKER):
                submit(replica)
        while running:
            ready, _ = ray.wait(list(running), num_returns=1)
            replica = running.pop(ready[0])
            submit(replica)
            yield ray.get(ready[0])
    finally:
        _release(ray, replicas, started_here)


def _release(ray: Any, replicas: list[Any], started_here: bool) -> None:
    for replica in replicas:
        ray.kill(replica)
    if started_here:
        ray.shutdown()
