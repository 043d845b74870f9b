"""Run layer-factor searches in a folder that survives being killed, then compare on a held-out split.

    out/
      search.json              the settings; a rerun with other settings is refused
      fitness_cache.jsonl      scores per (method, split, model), appended as each evaluation ends
      ga/checkpoint.json       optimiser state, evaluated individuals and history, rewritten
                               atomically after every generation; a rerun resumes from it
      ga/generations.jsonl     best and mean fitness per generation
      ga/rag_mspoe_method.json the best LayerWise config this optimiser found
      rag_mspoe_method.json    the overall pick: the best calibration fitness of all optimisers
      results.json             calibration and held-out scores of the picks and the baselines

Every optimiser gets the same budget of distinct fitness evaluations: the GA's (population and
generations decide it), or `budget` when given. Scores shared through the cache save time but
still count against each optimiser's budget.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rag_mspoe.eval.settings_search.bezier_ga import GASettings, Individual, from_json, individual_key
from rag_mspoe.eval.settings_search.fitness import (
    Evaluator,
    FitnessCache,
    FitnessWeights,
    Metric,
    PositionScores,
    evaluate_cached,
    utility,
)
from rag_mspoe.eval.settings_search.optimizers import OPTIMIZERS, CMAESSettings, Optimizer, make_optimizer
from rag_mspoe.files import atomic_write, check_output_folder, file_sha256
from rag_mspoe.methods import NAMED_METHODS, LayerWise, MethodConfig

logger = logging.getLogger(__name__)

BASELINES = ("none", "pi", "mspoe")


@dataclass(frozen=True)
class SearchSettings:
    optimizers: tuple[str, ...] = ("ga", "cmaes")
    metric: Metric = "choice"
    weights: FitnessWeights = field(default_factory=FitnessWeights)
    budget: int | None = None  # distinct evaluations per optimiser; None: what the GA used
    ga: GASettings = field(default_factory=GASettings)
    cmaes: CMAESSettings = field(default_factory=CMAESSettings)

    def __post_init__(self) -> None:
        object.__setattr__(self, "optimizers", tuple(self.optimizers))
        unknown = [name for name in self.optimizers if name not in OPTIMIZERS]
        if unknown or not self.optimizers or len(set(self.optimizers)) != len(self.optimizers):
            raise ValueError(
                f"Optimisers must be distinct names from {', '.join(OPTIMIZERS)}, got {self.optimizers}."
            )
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"budget must be at least 1 evaluation, got {self.budget}.")

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["optimizers"] = list(self.optimizers)
        return data


@dataclass
class OptimizerResult:
    name: str
    best: Individual
    fitness: float
    scores: PositionScores
    evaluations: int
    wall_s: float
    history: list[dict[str, Any]]

    @property
    def config(self) -> LayerWise:
        return layerwise_config(self.best)


def layerwise_config(individual: Individual) -> LayerWise:
    """The method config of an individual: its control points over layer index."""
    return LayerWise(control_points=[(float(x), float(y)) for x, y in individual])


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically: a reader (or a killed writer) never leaves half a file."""
    atomic_write(path, (json.dumps(data, indent=2) + "\n").encode())


def claim_search_folder(
    folder: Path, identity: dict[str, Any], check_unhashed_data: Callable[[], None] | None = None
) -> None:
    """Keep a search's settings in `folder/search.json`; refuse a rerun with other settings.

    Its `data` file is kept as a path relative to the folder and as the sha256 of its bytes
    (`data_sha256`): a rerun must give the same bytes, wherever they are now (a clone of a
    repository, another machine, another name), and another file, at the same path or not, is
    refused. A folder written before the digest was kept gets it on its next run, after
    `check_unhashed_data` found what the search already ran on unchanged."""
    path = folder / "search.json"
    identity = json.loads(json.dumps(identity))  # tuples as lists, as read back
    data = Path(identity["data"]) if "data" in identity else None
    if data is not None:
        identity["data"] = os.path.relpath(data.resolve(), folder.resolve())
        identity["data_sha256"] = file_sha256(data)
    if not path.is_file():
        check_output_folder(folder, path.name)
        folder.mkdir(parents=True, exist_ok=True)
        write_json(path, identity)
        return
    saved = json.loads(path.read_text())
    if data is not None:
        _refuse_other_data(folder, saved, data, identity["data_sha256"])
    differ = sorted(
        key for key in identity if key not in ("data", "data_sha256") and saved.get(key) != identity[key]
    )
    if differ:
        raise ValueError(
            f"{folder} holds a search with other settings (they differ in {', '.join(differ)}); "
            "rerun with the same settings to resume, or use another output folder (--out)."
        )
    if data is not None and "data_sha256" not in saved:
        if check_unhashed_data is not None:
            check_unhashed_data()
        write_json(path, {**saved, "data_sha256": identity["data_sha256"]})
        logger.warning(
            "%s kept no digest of its data (an older version started it); recorded sha256 %s of %s, so "
            "a rerun with another file there is refused.",
            folder,
            identity["data_sha256"],
            data,
        )


def _refuse_other_data(folder: Path, saved: dict[str, Any], data: Path, digest: str) -> None:
    """Raise ValueError unless `data` holds the bytes the search in `folder` started on: those it
    recorded the digest of, or (a folder from before digests) the file at its saved path."""
    recorded = saved.get("data_sha256")
    before = saved.get("data")
    if recorded is None:
        if _same_data(folder, before, data):
            return
        raise ValueError(
            f"{folder} holds a search on {before}, and {data} is another file; rerun with the same "
            "data to resume, or use another output folder."
        )
    if recorded == digest:
        return
    then = os.path.normpath(folder.resolve() / before) if isinstance(before, str) else "its data"
    where = "the file at that path then" if then == str(data.resolve()) else "that file"
    raise ValueError(
        f"{data} (sha256 {digest}) is not the data the search in {folder} started on: {then} (sha256 "
        f"{recorded}, {where}). Its rungs would mix the questions of two files. To resume, rerun with "
        f"the file it started on (restore it); to search on {data.name}, use a new --out folder."
    )


def _same_data(folder: Path, saved: Any, given: Path) -> bool:
    """Whether a saved data path (relative to the folder, or as older searches wrote it: absolute
    or relative to where they ran) names the given file or one with the same bytes."""
    if not isinstance(saved, str):
        return False
    for candidate in (folder / saved, Path(saved)):
        if candidate.is_file() and (
            os.path.samefile(candidate, given) or candidate.read_bytes() == given.read_bytes()
        ):
            return True
    return False


class LayerSearch:
    """The searches of one run folder: calibration evaluator, held-out evaluator, shared cache."""

    def __init__(
        self,
        folder: str | os.PathLike[str],
        settings: SearchSettings,
        calibration: Evaluator,
        num_layers: int,
    ) -> None:
        self.folder = Path(folder)
        self.settings = settings
        self.calibration = calibration
        self.num_layers = num_layers
        self._check_folder()  # before the cache's file: the folder may not be ours
        self.cache = FitnessCache(self.folder / "fitness_cache.jsonl")

    def _identity(self) -> dict[str, Any]:
        return {
            "settings": self.settings.to_dict(),
            "calibration_split": self.calibration.split.identity(),
            "model": self.calibration.model_name,
            "num_layers": self.num_layers,
        }

    def _check_folder(self) -> None:
        claim_search_folder(self.folder, self._identity())

    def fitness(self, scores: PositionScores) -> float:
        return utility(scores, self.settings.weights, self.settings.metric)

    # -- searches -----------------------------------------------------------------------------------
    def run(self) -> list[OptimizerResult]:
        """Every optimiser in turn, the GA first (its spend sets the others' budget)."""
        order = sorted(self.settings.optimizers, key=lambda name: name != "ga")
        budget = self.settings.budget
        results = []
        for name in order:
            if budget is None and name != "ga":
                budget = self.settings.ga.population_size * self.settings.ga.generations
            result = self.run_optimizer(name, None if name == "ga" else budget)
            if name == "ga" and budget is None:
                budget = result.evaluations
            results.append(result)
        best = max(results, key=lambda r: r.fitness)  # calibration fitness only: held-out stays unseen
        best.config.save(self.folder, base_model=self.calibration.model_name)
        return results

    def run_optimizer(self, name: str, budget: int | None) -> OptimizerResult:
        """One optimiser until it finishes or spends `budget`, resuming from its checkpoint."""
        folder = self.folder / name
        optimizer = make_optimizer(name, self.settings.ga, self.num_layers, self.settings.cmaes)
        state = self._load_checkpoint(folder, name, budget, optimizer)
        evaluated: dict[Individual, float] = {from_json(ind): f for ind, f in state["evaluated"]}
        started = time.monotonic()
        while not state["done"]:
            population = optimizer.ask()
            if not population:  # a small grid can run out of individuals never seen
                state["done"] = True
                self._save_checkpoint(folder, state)
                break
            new = list(dict.fromkeys(ind for ind in population if ind not in evaluated))
            partial = budget is not None and len(evaluated) + len(new) > budget
            if partial:
                new = new[: budget - len(evaluated)]  # type: ignore[operator]
            labels = [f"{name} {individual_key(ind)}" for ind in new]
            scores = evaluate_cached(self.calibration, self.cache, [layerwise_config(i) for i in new], labels)
            for individual, score in zip(new, scores, strict=True):
                evaluated[individual] = self.fitness(score)
            members = new if partial else population
            fitnesses = [evaluated[ind] for ind in members]
            if not partial:
                optimizer.tell([(ind, evaluated[ind]) for ind in population])
            state["history"].append(
                {
                    "generation": len(state["history"]),
                    "evaluations": len(evaluated),
                    "new": len(new),
                    "best_so_far": max(evaluated.values()),
                    "best": max(fitnesses),
                    "mean": sum(fitnesses) / len(fitnesses),
                    "population": [[[x, y] for x, y in ind] for ind in members],
                }
            )
            state["evaluated"] = [[[[x, y] for x, y in ind], f] for ind, f in evaluated.items()]
            state["optimizer"] = optimizer.state_dict()
            state["wall_s"] += time.monotonic() - started
            started = time.monotonic()
            spent = budget is not None and len(evaluated) >= budget
            state["done"] = partial or spent or optimizer.finished or not new
            self._save_checkpoint(folder, state)
            last = state["history"][-1]
            logger.info(
                "%s generation %d: %d evaluations, best %.4f, mean %.4f",
                name,
                last["generation"],
                last["evaluations"],
                last["best_so_far"],
                last["mean"],
            )
        return self._result(name, state, evaluated, folder)

    def _load_checkpoint(
        self, folder: Path, name: str, budget: int | None, optimizer: Optimizer
    ) -> dict[str, Any]:
        path = folder / "checkpoint.json"
        if not path.is_file():
            return {
                "optimizer_name": name,
                "budget": budget,
                "done": False,
                "wall_s": 0.0,
                "evaluated": [],
                "history": [],
            }
        state = json.loads(path.read_text())
        if state["budget"] != budget:
            raise ValueError(
                f"{path} was written with a budget of {state['budget']} evaluations, now {budget}; "
                "rerun with the same settings or use another output folder (--out)."
            )
        optimizer.load_state_dict(state["optimizer"])
        logger.warning(
            "%s: resuming after generation %d (%d evaluations done)",
            name,
            len(state["history"]) - 1,
            len(state["evaluated"]),
        )
        return state

    def _save_checkpoint(self, folder: Path, state: dict[str, Any]) -> None:
        write_json(folder / "checkpoint.json", state)
        log = "".join(
            json.dumps({k: v for k, v in row.items() if k != "population"}) + "\n" for row in state["history"]
        )
        atomic_write(folder / "generations.jsonl", log.encode())

    def _result(
        self, name: str, state: dict[str, Any], evaluated: dict[Individual, float], folder: Path
    ) -> OptimizerResult:
        if not evaluated:
            raise RuntimeError(f"The {name} search evaluated nothing; raise the population size or budget.")
        best = max(evaluated, key=lambda ind: evaluated[ind])  # the first evaluated among equals
        (scores,) = evaluate_cached(self.calibration, self.cache, [layerwise_config(best)])
        result = OptimizerResult(
            name, best, evaluated[best], scores, len(evaluated), state["wall_s"], state["history"]
        )
        result.config.save(folder, base_model=self.calibration.model_name)
        return result

    # -- comparison -------------------------------------------------------------------------------
    def compare(self, results: Sequence[OptimizerResult], heldout: Evaluator | None) -> list[dict[str, Any]]:
        """Rows of (method, split) scores: the baselines and every optimiser's pick, on the
        calibration split and, when given, the held-out split. Written to results.json."""
        methods: list[tuple[str, MethodConfig | None]] = [
            ("none", None),
            *((name, NAMED_METHODS[name]) for name in BASELINES[1:]),
            *((f"layerwise-{r.name}", r.config) for r in results),
        ]
        splits = {"calibration": self.calibration, **({"held-out": heldout} if heldout else {})}
        rows = comparison_rows(splits, self.cache, methods, self.fitness)
        write_json(
            self.folder / "results.json",
            {
                **self._identity(),
                "heldout_split": heldout.split.identity() if heldout else None,
                "optimizers": [
                    {
                        "name": r.name,
                        "control_points": [[x, y] for x, y in r.best],
                        "factors": r.config.layer_factors(self.num_layers),
                        "fitness": r.fitness,
                        "evaluations": r.evaluations,
                        "wall_s": r.wall_s,
                    }
                    for r in results
                ],
                "rows": rows,
            },
        )
        return rows


def comparison_rows(
    splits: dict[str, Evaluator],
    cache: FitnessCache,
    methods: Sequence[tuple[str, MethodConfig | None]],
    fitness: Callable[[PositionScores], float],
) -> list[dict[str, Any]]:
    """Scores of every (label, method) on every split, one row each, split by split."""
    rows = []
    for split_name, evaluator in splits.items():
        scores = evaluate_cached(evaluator, cache, [m for _, m in methods], [label for label, _ in methods])
        for (label, method), score in zip(methods, scores, strict=True):
            rows.append(
                {
                    "method": label,
                    "split": split_name,
                    "accuracy": score.accuracy,
                    "average": score.average_accuracy,
                    "fitness": fitness(score),
                    "scores": score.to_dict(),
                    "config": None if method is None else method.to_dict(),
                }
            )
    return rows
