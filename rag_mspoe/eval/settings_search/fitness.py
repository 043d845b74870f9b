"""Context utilisation (Eq. 11): how well a method uses the gold document at the first, middle and
last position of a calibration split: a small sweep (its examples, scorer and records), so a
calibrated method is judged by the numbers the evaluation reports. Over Ray it runs on the
evaluation's workers, kept for the whole search.

    split = CalibrationSplit(num_documents=5, num_examples=16, seed=1)
    evaluator = LocalEvaluator(engine, split)
    cache = FitnessCache("runs/cal/fitness_cache.jsonl")
    (scores,) = evaluate_cached(evaluator, cache, [LayerWise(control_points=[...])])
    utility(scores, FitnessWeights(), "choice")      # lf*Af + lm*Am + ll*Al

Every prompt is scored once per method: forced choice among the answer candidates in the
context gives the accuracy (`choice_correct`), the gold's share of the softmax over the
candidates' mean log-probabilities (`choice_share`, a smooth accuracy that tiny splits need), and
the gold's mean log-probability per token (`gold_logprob / gold_tokens`). Any of the three can
serve as A in Eq. 11; the cache keeps all three.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from tqdm.auto import tqdm

from rag_mspoe.methods import MethodConfig
from rag_mspoe.prompts.chat_template import Prompt

if TYPE_CHECKING:
    from rag_mspoe.engine.protocol import EngineLike
    from rag_mspoe.eval.method_engines import EngineSet
    from rag_mspoe.eval.runs.ray_backend import WorkerPool
    from rag_mspoe.eval.sweep.plan import Example, SweepConfig

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
    prompt: Prompt
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

    def sweep_config(self) -> SweepConfig:
        """The sweep that scores this split: its examples, its three positions, forced choice."""
        from rag_mspoe.eval.sweep.plan import SweepConfig

        return SweepConfig(
            task=self.task,
            num_documents=self.num_documents,
            positions=tuple(self.positions.values()),
            samples=self.num_examples,
            generator="invented-qa" if self.task == "qa" else "kv-short",
            distractor_similarity=self.distractor_similarity,
            seed=self.seed,
            metrics=("choice",),
        )

    def examples(self) -> list[Example]:
        from rag_mspoe.eval.sweep.plan import load_examples

        return load_examples(self.sweep_config())

    def items(self) -> list[Item]:
        from rag_mspoe.eval.data.records import with_gold_at
        from rag_mspoe.eval.sweep.batch_scorer import candidates_of, prompt_of

        items = []
        for example in self.examples():
            for name, index in self.positions.items():
                placed = with_gold_at(example, index)
                candidates, gold = candidates_of(placed)
                items.append(Item(name, placed.id, prompt_of(placed), candidates, gold))
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
    def of(cls, split: CalibrationSplit, records: Sequence[dict[str, Any]]) -> PositionScores:
        """Average one method's forced-choice records (the sweep scorer's) on `split` per position."""
        names = {index: name for name, index in split.positions.items()}
        sums: dict[str, list[float]] = {name: [0.0, 0.0, 0.0] for name in POSITIONS}
        counts = dict.fromkeys(POSITIONS, 0)
        for record in records:
            position = names[record["position"]]
            values = (
                record["choice_correct"],
                record["choice_share"],
                record["gold_logprob"] / record["gold_tokens"],
            )
            sums[position] = [a + b for a, b in zip(sums[position], values, strict=True)]
            counts[position] += 1
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


class SplitScorer:
    """Scores methods on splits with the sweep's scorer (`BatchScorer`), one example's three
    positions at a time; a split's examples are built once."""

    def __init__(self, engines: EngineSet) -> None:
        self.engines = engines
        self._examples: dict[CalibrationSplit, list[Example]] = {}

    def records(
        self, split: CalibrationSplit, index: int, method: MethodConfig | None, progress: bool = False
    ) -> list[dict[str, Any]]:
        """The records of `method` (None: the unmodified model) on every item; they carry `index`
        as the method's name, so records coming back from a worker say whose they are."""
        from rag_mspoe.eval.sweep.batch_scorer import BatchScorer
        from rag_mspoe.eval.sweep.plan import Batch
        from rag_mspoe.methods.method_spec import ResolvedMethod

        if split not in self._examples:
            self._examples[split] = split.examples()
        named = ResolvedMethod(str(index), method)
        scorer = BatchScorer(split.sweep_config(), self._examples[split], [named], self.engines)
        positions = split.positions.values()
        records = []
        for example in tqdm(range(split.num_examples), desc="examples", leave=False, disable=not progress):
            records += scorer.score(Batch(named.name, tuple((p, example) for p in positions)))
        return records


class Evaluator(Protocol):
    """Scores methods on one split; yields (index in `methods`, scores) as each one finishes."""

    model_name: str
    split: CalibrationSplit

    def evaluate(self, methods: Sequence[MethodConfig | None]) -> Iterator[tuple[int, PositionScores]]: ...


class LocalEvaluator:
    """One method after another on the engine's model in this process."""

    def __init__(self, engine: EngineLike, split: CalibrationSplit, progress: bool = True) -> None:
        from rag_mspoe.eval.method_engines import EngineSet

        self.split = split
        self.model_name = engine.name
        self.progress = progress
        self._scorer = SplitScorer(EngineSet(engine.model, engine.tokenizer))

    def evaluate(self, methods: Sequence[MethodConfig | None]) -> Iterator[tuple[int, PositionScores]]:
        for index, method in enumerate(methods):
            records = self._scorer.records(self.split, index, method, self.progress)
            yield index, PositionScores.of(self.split, records)


@dataclass(frozen=True)
class _ModelSource:
    model: str | None  # as `load_model` takes it


@dataclass(frozen=True)
class _FitnessUnits:
    """Fitness as units of the evaluation's Ray workers: a unit is (split, index, method) and its
    records are those of `SplitScorer.records`."""

    config: _ModelSource

    def scorer(self, model: Any, tokenizer: Any) -> Any:
        from rag_mspoe.eval.method_engines import EngineSet

        scorer = SplitScorer(EngineSet(model, tokenizer))
        return lambda unit: scorer.records(*unit)


def start_ray_workers(
    source: str | None,
    workers: int,
    threads: int = 1,
    device: str | None = "auto",
    dtype: str | None = None,
    quantize: str | None = None,
) -> WorkerPool:
    """`workers` replicas of the model (`source`, `device`, `dtype` and `quantize` as `load_model` takes them)
    that score fitness until the pool is closed; every generation and split reuses them.

    Connects to a running cluster when RAY_ADDRESS is set, else starts Ray on this machine.
    """
    from rag_mspoe.eval.runs.ray_backend import WorkerPool

    address = os.environ.get("RAY_ADDRESS") or "local"
    return WorkerPool(_FitnessUnits(_ModelSource(source)), address, workers, threads, device, dtype, quantize)


class RayEvaluator:
    """Methods spread over a pool from `start_ray_workers`; several splits may share it."""

    def __init__(self, pool: WorkerPool, split: CalibrationSplit, model_name: str) -> None:
        self.pool = pool
        self.split = split
        self.model_name = model_name

    def evaluate(self, methods: Sequence[MethodConfig | None]) -> Iterator[tuple[int, PositionScores]]:
        units = [(self.split, index, method) for index, method in enumerate(methods)]
        for records in self.pool.map(units):
            yield int(records[0]["method"]), PositionScores.of(self.split, records)


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
