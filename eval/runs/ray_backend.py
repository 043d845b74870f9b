"""Fan an evaluation's units of work out over Ray workers, each holding one model replica.

Workers only score; the driver writes every record, so results.jsonl has one writer and the
once-only guarantee of a local run holds. Each worker is kept two units busy, so it never
waits for the driver between units.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

from rag_mspoe.eval.runs.loop import Evaluation

RAY_INSTALL = "pip install 'rag-mspoe[ray]'"
_IN_FLIGHT_PER_WORKER = 2


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError(f"--ray needs the ray package; install it with: {RAY_INSTALL}") from None
    return ray


class Worker:
    """One model replica scoring units of an evaluation (the body of a Ray actor).

    The evaluation arrives pickled with its methods already resolved: nothing is parsed here."""

    def __init__(
        self,
        evaluation: Evaluation,
        threads: int | None,
        device: str | None = "auto",
        dtype: str | None = None,
    ) -> None:
        from rag_mspoe import load_model
        from rag_mspoe.eval.runs.manifest import model_facts

        model, tokenizer = load_model(
            evaluation.config.model, device=device, dtype=dtype, threads=threads or 1
        )
        self.facts = model_facts(model)
        self.scorer = evaluation.scorer(model, tokenizer)

    def model_facts(self) -> dict[str, Any]:
        return self.facts

    def score(self, unit: Any) -> list[dict[str, Any]]:
        return self.scorer(unit)


def connect(address: str, workers: int) -> bool:
    """Join a cluster (an address) or start a local Ray with one CPU per worker; True if started here."""
    ray = _import_ray()
    if ray.is_initialized():
        return False
    if address == "local":
        # Ray starts its workers at nice 15; on a busy machine they would then wait behind every
        # other process (measured: a 4 s import took 50 s), though they do all of the run's work.
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)
    return True


def score_on_ray(
    evaluation: Evaluation,
    units: Sequence[Any],
    address: str,
    workers: int,
    threads: int | None,
    device: str | None = "auto",
    dtype: str | None = None,
) -> tuple[Iterator[list[dict[str, Any]]], dict[str, Any]]:
    """Start `workers` replicas and return (records of each unit as it completes, model facts)."""
    ray = _import_ray()
    started_here = connect(address, workers)
    actor = ray.remote(num_cpus=1)(Worker)
    replicas = [actor.remote(evaluation, threads, device, dtype) for _ in range(min(workers, len(units)))]
    try:
        facts = ray.get(replicas[0].model_facts.remote())
    except BaseException:
        _release(ray, replicas, started_here)
        raise
    return _stream(ray, replicas, units, started_here), facts


def _stream(
    ray: Any, replicas: list[Any], units: Sequence[Any], started_here: bool
) -> Iterator[list[dict[str, Any]]]:
    queue = list(units)[::-1]
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
