"""Fan an evaluation's units of work out over Ray workers, each holding one model replica.

Workers only score; the driver writes every record, so results.jsonl has one writer and the
once-only guarantee of a local run holds. Each worker is kept two units busy, so it never
waits for the driver between units, and is given the units that share work with its earlier
ones (the other labels of a sweep's examples: their documents' caches and scores are in that
worker's memory). A `WorkerPool` keeps its replicas across calls; anything with a `config.model`
and a `scorer(model, tokenizer)` can run on it, not only an `Evaluation` (calibration scores its
candidates this way).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

from rag_mspoe.eval.runs.heap import releasing
from rag_mspoe.eval.runs.units import UnitScoring

RAY_INSTALL = "pip install 'rag-mspoe[ray]'"
_IN_FLIGHT_PER_WORKER = 2
_RECENT_KEYS = 4  # units whose work a worker's caches are taken to hold (they keep the latest)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError(f"--ray needs the ray package; install it with: {RAY_INSTALL}") from None
    return ray


class Worker:
    """One model replica scoring units of an evaluation (the body of a Ray actor).

    The evaluation arrives pickled with its methods already resolved: nothing is parsed here;
    load_options: what `load_model` takes besides the model (device, dtype, threads, quantize)."""

    def __init__(self, evaluation: UnitScoring, load_options: dict[str, Any]) -> None:
        from rag_mspoe import load_model
        from rag_mspoe.eval.runs.manifest import model_facts

        model, tokenizer = load_model(evaluation.config.model, **load_options)
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
        load_options = {"device": device, "dtype": dtype, "threads": threads or 1, "quantize": quantize}
        self._replicas = [actor.remote(evaluation, load_options) for _ in range(workers)]
        try:
            self.facts: dict[str, Any] = self._ray.get(self._replicas[0].model_facts.remote())
        except BaseException:
            self.close()
            raise

    def map(
        self, units: Sequence[Any], shared_work: Callable[[Any], Hashable | None] | None = None
    ) -> Iterator[list[dict[str, Any]]]:
        """The records of each unit, in the order the units complete. shared_work: what a unit
        shares with others that a worker keeps in its caches (a sweep's batch: its examples); a
        worker is then given the units that share its earlier ones (`Dispatcher`)."""
        ray = self._ray
        dispatcher = Dispatcher(units, len(self._replicas), shared_work)
        running: dict[Any, int] = {}  # object ref -> index of the replica scoring it

        def submit(replica: int) -> None:
            unit = dispatcher.take(replica)
            if unit is not None:
                running[self._replicas[replica].score.remote(unit)] = replica

        for replica in range(len(self._replicas)):
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


class Dispatcher:
    """Which unit each of `workers` workers scores next, the units in plan order.

    shared_work(unit): what a unit shares with others that a worker keeps in its caches, or None.
    A worker takes the first unit that shares work with one it had lately (its caches hold that
    work), else the first that no other worker had lately (a fresh start, so the plan's order
    holds), else the first. Without shared work, the units go in plan order.
    """

    def __init__(
        self, units: Sequence[Any], workers: int, shared_work: Callable[[Any], Hashable | None] | None = None
    ) -> None:
        self._units = list(units)
        self._keys = [shared_work(unit) if shared_work else None for unit in self._units]
        self._recent: list[deque[Hashable]] = [deque(maxlen=_RECENT_KEYS) for _ in range(workers)]

    def take(self, worker: int) -> Any | None:
        """The next unit for `worker` (None when none is left)."""
        if not self._units:
            return None
        mine = self._recent[worker]
        others = {key for k, held in enumerate(self._recent) if k != worker for key in held}
        chosen = 0
        for wanted in (lambda key: key in mine, lambda key: key not in others):
            found = next((k for k, key in enumerate(self._keys) if key is not None and wanted(key)), None)
            if found is not None:
                chosen = found
                break
        key = self._keys.pop(chosen)
        if key is not None:
            if key in mine:
                mine.remove(key)
            mine.append(key)
        return self._units.pop(chosen)


def score_on_ray(
    evaluation: UnitScoring,
    units: Sequence[Any],
    address: str,
    workers: int,
    threads: int | None,
    device: str | None = "auto",
    dtype: str | None = None,
    quantize: str | None = None,
    shared_work: Callable[[Any], Hashable | None] | None = None,
) -> tuple[Iterator[list[dict[str, Any]]], dict[str, Any]]:
    """Start `workers` replicas (no more than units) and return (records of each unit as it
    completes, model facts); the replicas stop when the stream ends or is closed."""
    pool = WorkerPool(evaluation, address, min(workers, len(units)), threads, device, dtype, quantize)
    return _stream_once(pool, units, shared_work), pool.facts


def _stream_once(
    pool: WorkerPool, units: Sequence[Any], shared_work: Callable[[Any], Hashable | None] | None
) -> Iterator[list[dict[str, Any]]]:
    with pool:
        yield from pool.map(units, shared_work)
