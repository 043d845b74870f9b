"""Fan an evaluation's units of work out over Ray workers, each holding one model replica.

Workers only score; the driver writes every record, so results.jsonl has one writer and the
once-only guarantee of a local run holds. Each worker is kept two units busy, so it never
waits for the driver between units. A `WorkerPool` keeps its replicas across calls; anything
with a `config.model` and a `scorer(model, tokenizer)` can run on it, not only an `Evaluation`
(calibration scores its candidates this way).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

from rag_mspoe.eval.runs.heap import releasing
from rag_mspoe.eval.runs.units import UnitScoring

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
        evaluation: UnitScoring,
        threads: int | None,
        device: str | None = "auto",
        dtype: str | None = None,
        quantize: str | None = None,
    ) -> None:
        from rag_mspoe import load_model
        from rag_mspoe.eval.runs.manifest import model_facts

        model, tokenizer = load_model(
            evaluation.config.model, device=device, dtype=dtype, threads=threads or 1, quantize=quantize
        )
        self.facts = model_facts(model)
        self.scorer = releasing(evaluation.scorer(model, tokenizer))

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


def lost_worker_message(exc: BaseException) -> str:
    """What to do when Ray lost a worker (killed for memory, crashed, its node gone)."""
    first_line = (str(exc).strip().splitlines() or [""])[0][:300]
    return (
        f"A Ray worker was lost ({type(exc).__name__}: {first_line}). The records scored so far are "
        "saved: rerun the same command to go on. Each worker holds a model replica; when memory runs "
        "short, run fewer workers (--ray-workers) or free memory for them."
    )


class WorkerPool:
    """`workers` model replicas kept across calls: a sweep maps its units once, calibration maps
    each generation's methods on the same replicas (a model load per generation would cost more
    than the generation). Close it, or use it as a context manager, to stop them.
    """

    def __init__(
        self,
        evaluation: UnitScoring,
        address: str,
        workers: int,
        threads: int | None,
        device: str | None = "auto",
        dtype: str | None = None,
        quantize: str | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}.")
        self._ray = _import_ray()
        self._started_here = connect(address, workers)
        actor = self._ray.remote(num_cpus=1)(Worker)
        self._replicas = [actor.remote(evaluation, threads, device, dtype, quantize) for _ in range(workers)]
        try:
            self.facts: dict[str, Any] = self._ray.get(self._replicas[0].model_facts.remote())
        except BaseException:
            self.close()
            raise

    def map(self, units: Sequence[Any]) -> Iterator[list[dict[str, Any]]]:
        """The records of each unit, in the order the units complete."""
        ray = self._ray
        queue = list(units)[::-1]
        running: dict[Any, Any] = {}  # object ref -> replica scoring it

        def submit(replica: Any) -> None:
            if queue:
                running[replica.score.remote(queue.pop())] = replica

        for replica in self._replicas:
            for _ in range(_IN_FLIGHT_PER_WORKER):
                submit(replica)
        lost = (
            ray.exceptions.OutOfMemoryError,
            ray.exceptions.RayActorError,
            ray.exceptions.WorkerCrashedError,
            ray.exceptions.NodeDiedError,
        )
        while running:
            ready, _ = ray.wait(list(running), num_returns=1)
            replica = running.pop(ready[0])
            submit(replica)
            try:
                records = ray.get(ready[0])
            except lost as exc:
                raise RuntimeError(lost_worker_message(exc)) from exc
            yield records

    def close(self) -> None:
        for replica in self._replicas:
            self._ray.kill(replica)
        self._replicas = []
        if self._started_here:
            self._ray.shutdown()
            self._started_here = False

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def score_on_ray(
    evaluation: UnitScoring,
    units: Sequence[Any],
    address: str,
    workers: int,
    threads: int | None,
    device: str | None = "auto",
    dtype: str | None = None,
    quantize: str | None = None,
) -> tuple[Iterator[list[dict[str, Any]]], dict[str, Any]]:
    """Start `workers` replicas (no more than units) and return (records of each unit as it
    completes, model facts); the replicas stop when the stream ends or is closed."""
    pool = WorkerPool(evaluation, address, min(workers, len(units)), threads, device, dtype, quantize)
    return _stream_once(pool, units), pool.facts


def _stream_once(pool: WorkerPool, units: Sequence[Any]) -> Iterator[list[dict[str, Any]]]:
    with pool:
        yield from pool.map(units)
