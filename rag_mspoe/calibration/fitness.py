"""Context utilisation (Eq. 11): how well a method uses the gold document at the first, middle and
last position of a calibration split, scored with forced choice through the engine.

    split = CalibrationSplit(num_documents=5, num_examples=16, seed=1)
    evaluator = LocalEvaluator(engine, split)
    cache = FitnessCache("runs/cal/fitness_cache.jsonl")
    (scores,) = evaluate_cached(evaluator, cache, [LayerWise(control_points=[...])])
    utility(scores, FitnessWeights(), "choice")      # lf*Af + lm*Am + ll*Al

Every prompt is scored once per method: forced choice among the answer candidates in the
context gives the accuracy, the gold's share of the softmax over the candidates' mean
log-probabilities (a smooth accuracy that tiny splits need), and the gold's mean log-probability
per token. Any of the three can serve as A in Eq. 11; the cache keeps all three.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from tqdm.auto import tqdm

from rag_mspoe.methods import MethodConfig

POSITIONS = ("first", "middle", "last")
Metric = Literal["choice", "choice-prob", "loglik"]
METRICS: tuple[Metric, ...] = ("choice", "choice-prob", "loglik")
Task = Literal["qa", "kv"]


@dataclass(frozen=True)
class FitnessWeights:
    """lambda_f, lambda_m, lambda_l of Eq. 11; Eq. 12 asks 0 < first < middle < last, so a method
    may not buy middle accuracy with the end of the context."""

    first: float = 0.2
    middle: float = 0.3
    last: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.first < self.middle < self.last:
            raise ValueError(
                f"Fitness weights must satisfy 0 < first < middle < last (Eq. 12), got first={self.first}, "
                f"middle={self.middle}, last={self.last}; e.g. 0.2,0.3,0.5."
            )

    @classmethod
    def parse(cls, text: str) -> FitnessWeights:
        """From 'first,middle,last', e.g. '0.2,0.3,0.5'."""
        parts = text.split(",")
        if len(parts) != 3:
            raise ValueError(
                f"Give three comma-separated weights first,middle,last (e.g. 0.2,0.3,0.5), got {text!r}."
            )
        try:
            first, middle, last = (float(part) for part in parts)
        except ValueError as exc:
            raise ValueError(f"Weights must be numbers, got {text!r}.") from exc
        return cls(first, middle, last)


@dataclass(frozen=True)
class Item:
    """One prompt of a split: the gold at `position` (first, middle or last)."""

    position: str
    example_id: str
    prompt: str
    candidates: tuple[str, ...]
    gold: str


@dataclass(frozen=True)
class CalibrationSplit:
    """Generated examples, each asked with its gold at the first, middle and last position.

    Calibration and held-out splits are the same generator with different seeds.
    """

    task: Task = "qa"
    num_documents: int = 5
    num_examples: int = 16
    seed: int = 1
    distractor_similarity: float = 0.5

    def __post_init__(self) -> None:
        if self.task not in ("qa", "kv"):
            raise ValueError(f"task must be 'qa' or 'kv', got {self.task!r}.")
        if self.num_documents < 3:
            raise ValueError(
                f"A first, middle and last position need at least 3 documents, got {self.num_documents}."
            )
        if self.num_examples < 1:
            raise ValueError(f"num_examples must be at least 1, got {self.num_examples}.")

    @property
    def positions(self) -> dict[str, int]:
        return {"first": 0, "middle": (self.num_documents - 1) // 2, "last": self.num_documents - 1}

    def identity(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def items(self) -> list[Item]:
        from rag_mspoe.eval.data import prompts, synthetic
        from rag_mspoe.eval.data.records import KVExample, with_gold_at

        examples: Sequence[Any]
        if self.task == "qa":
            examples = synthetic.generate_invented_qa(
                self.num_documents, self.num_examples, self.seed, self.distractor_similarity
            )
        else:
            examples = synthetic.generate_kv(
                self.num_documents, self.num_examples, self.seed, short_keys=True
            )
        items = []
        for example in examples:
            for name, index in self.positions.items():
                placed = with_gold_at(example, index)
                if isinstance(placed, KVExample):
                    prompt = prompts.kv_prompt(placed)
                    candidates, gold = tuple(value for _, value in placed.pairs), placed.value
                else:
                    prompt, candidates, gold = prompts.qa_prompt(placed), placed.candidates, placed.answers[0]
                items.append(Item(name, placed.id, prompt, candidates, gold))
        return items


@dataclass(frozen=True)
class PositionScores:
    """What one method scores on a split, per position: forced-choice accuracy, the gold's mean
    probability among the candidates, and the gold's mean log-probability per token."""

    accuracy: dict[str, float]
    probability: dict[str, float]
    loglik: dict[str, float]
    count: int

    def metric(self, metric: Metric) -> dict[str, float]:
        if metric == "choice":
            return self.accuracy
        if metric == "choice-prob":
            return self.probability
        if metric == "loglik":
            return self.loglik
        raise ValueError(f"Unknown fitness metric {metric!r}; choose from {', '.join(METRICS)}.")

    @property
    def average_accuracy(self) -> float:
        return sum(self.accuracy.values()) / len(self.accuracy)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PositionScores:
        return cls(data["accuracy"], data["probability"], data["loglik"], int(data["count"]))

    @classmethod
    def of(cls, items: Sequence[Item], results: Sequence[dict[str, Any]]) -> PositionScores:
        """Average the forced-choice results of `items` per position."""
        sums: dict[str, list[float]] = {name: [0.0, 0.0, 0.0] for name in POSITIONS}
        counts = dict.fromkeys(POSITIONS, 0)
        for item, result in zip(items, results, strict=True):
            scores = result["scores"]
            top = max(scores.values())
            share = math.exp(scores[item.gold] - top) / sum(math.exp(s - top) for s in scores.values())
            values = (result["correct"], share, result["gold_sum"] / result["gold_tokens"])
            sums[item.position] = [a + b for a, b in zip(sums[item.position], values, strict=True)]
            counts[item.position] += 1
        if len(set(counts.values())) != 1 or not counts["first"]:
            raise ValueError(f"Every position needs the same number of items, got {counts}.")
        n = counts["first"]
        return cls(
            accuracy={p: sums[p][0] / n for p in POSITIONS},
            probability={p: sums[p][1] / n for p in POSITIONS},
            loglik={p: sums[p][2] / n for p in POSITIONS},
            count=n,
        )


def utility(scores: PositionScores, weights: FitnessWeights, metric: Metric) -> float:
    """Eq. 11: U = lf*Af + lm*Am + ll*Al."""
    a = scores.metric(metric)
    return weights.first * a["first"] + weights.middle * a["middle"] + weights.last * a["last"]


def score_items(
    engine: Any, items: Sequence[Item], method: MethodConfig | None, progress: bool = False
) -> PositionScores:
    """Forced choice on every item through the engine, with `method` (None: the unmodified model)."""
    from rag_mspoe.eval.scoring.model_scores import score_forced_choice

    spec: Any = "none" if method is None else method
    results = [
        score_forced_choice(engine, item.prompt, item.candidates, item.gold, method=spec)
        for item in tqdm(items, desc="prompts", leave=False, disable=not progress)
    ]
    return PositionScores.of(items, results)


class Evaluator(Protocol):
    """Scores methods on one split; yields (index in `methods`, scores) as each one finishes."""

    model_name: str
    split: CalibrationSplit

    def evaluate(self, methods: Sequence[MethodConfig | None]) -> Iterator[tuple[int, PositionScores]]: ...


class LocalEvaluator:
    """One method after another on the engine in this process."""

    def __init__(self, engine: Any, split: CalibrationSplit, progress: bool = True) -> None:
        self.engine = engine
        self.split = split
        self.model_name = engine.name
        self.progress = progress
        self._items = split.items()

    def evaluate(self, methods: Sequence[MethodConfig | None]) -> Iterator[tuple[int, PositionScores]]:
        for index, method in enumerate(methods):
            yield index, score_items(self.engine, self._items, method, self.progress)


class _RayWorker:
    """A model loaded once per Ray worker, scoring whole methods on any split."""

    def __init__(self, source: str | None, threads: int, device: str | None, dtype: str | None) -> None:
        from rag_mspoe.engine import Engine

        self.engine = Engine.load(source, threads=threads, device=device, dtype=dtype)
        self.items: dict[str, list[Item]] = {}

    def score(
        self, index: int, method: dict[str, Any] | None, split: dict[str, Any]
    ) -> tuple[int, dict[str, Any]]:
        key = json.dumps(split, sort_keys=True)
        if key not in self.items:
            self.items[key] = CalibrationSplit(**split).items()
        config = MethodConfig.from_dict(method) if method is not None else None
        return index, score_items(self.engine, self.items[key], config).to_dict()


def start_ray_workers(
    source: str | None,
    workers: int,
    threads: int = 1,
    device: str | None = "auto",
    dtype: str | None = None,
) -> list[Any]:
    """`workers` Ray actors, each with its own copy of the model (`source`, `device` and `dtype` as
    `load_model` takes them).

    Connects to a running cluster when RAY_ADDRESS is set, else starts Ray on this machine.
    """
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError("Parallel fitness over Ray needs Ray: pip install 'rag-mspoe[ray]'.") from exc
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}.")
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False, include_dashboard=False)
    actor = ray.remote(num_cpus=threads)(_RayWorker)
    return [actor.remote(source, threads, device, dtype) for _ in range(workers)]  # type: ignore[attr-defined]


class RayEvaluator:
    """Methods spread over Ray actors from `start_ray_workers`; several splits may share them."""

    def __init__(self, workers: Sequence[Any], split: CalibrationSplit, model_name: str) -> None:
        self.workers = list(workers)
        self.split = split
        self.model_name = model_name

    def evaluate(self, methods: Sequence[MethodConfig | None]) -> Iterator[tuple[int, PositionScores]]:
        from ray.util import ActorPool

        pool = ActorPool(self.workers)
        split = self.split.identity()
        jobs = [(index, None if m is None else m.to_dict()) for index, m in enumerate(methods)]
        for index, scores in pool.map_unordered(lambda actor, job: actor.score.remote(*job, split), jobs):
            yield index, PositionScores.from_dict(scores)


class FitnessCache:
    """Scores per (method, split, model) in a results file of the evaluation runs (one record per
    key, a torn last line repaired), appended as each evaluation ends, so a killed search never
    evaluates the same individual twice."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from rag_mspoe.eval.runs.results import ResultsFile, read_records

        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._results = ResultsFile(self.path, ("key",))
        self._entries = {r["key"]: PositionScores.from_dict(r["scores"]) for r in read_records(self.path)}

    @staticmethod
    def key(method: MethodConfig | None, split: CalibrationSplit, model_name: str) -> str:
        identity = {
            "method": None if method is None else method.to_dict(),
            "split": split.identity(),
            "model": model_name,
        }
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> PositionScores | None:
        return self._entries.get(key)

    def put(self, key: str, scores: PositionScores, label: str) -> None:
        self._entries[key] = scores
        self._results.append([{"key": key, "label": label, "scores": scores.to_dict()}])


def evaluate_cached(
    evaluator: Evaluator,
    cache: FitnessCache,
    methods: Sequence[MethodConfig | None],
    labels: Sequence[str] | None = None,
) -> list[PositionScores]:
    """Scores of every method, from the cache where it has them; the others are evaluated (each
    distinct one once) and added to the cache as they finish."""
    keys = [cache.key(m, evaluator.split, evaluator.model_name) for m in methods]
    labels = labels or [m.kind if m is not None else "none" for m in methods]
    missing: dict[str, int] = {}
    for index, key in enumerate(keys):
        if cache.get(key) is None:
            missing.setdefault(key, index)
    todo = list(missing.values())
    with tqdm(total=len(todo), desc="fitness", leave=False, disable=not todo) as bar:
        for position, scores in evaluator.evaluate([methods[i] for i in todo]):
            index = todo[position]
            cache.put(keys[index], scores, labels[index])
            bar.update()
    found = [cache.get(key) for key in keys]
    if any(scores is None for scores in found):
        raise RuntimeError("The evaluator returned fewer scores than methods; check the Ray workers' logs.")
    return [scores for scores in found if scores is not None]
