"""Optimisers over the same control-point grid as the genetic algorithm, for comparison at equal cost.

Each is an ask/tell object like `BezierGA`: `ask` gives individuals to evaluate, `tell` takes
their fitness, `state_dict` checkpoints it. The search runner gives each one the same number of
distinct fitness evaluations (the budget), so they compare at equal model time.

- CMA-ES (the `cmaes` library) searches a continuous box, one coordinate per control point x
  and y scaled to [0, 1]; every sample is snapped to the nearest valid grid individual
  (`Grid.repair`), and CMA-ES learns from the fitness of the snapped individual.
- Random search draws valid grid individuals uniformly: the floor any optimiser must beat.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from rag_mspoe.eval.settings_search.bezier_ga import BezierGA, GASettings, Individual, Scored, from_json

OPTIMIZERS = ("ga", "cmaes", "random")


class Optimizer(Protocol):
    name: str

    @property
    def finished(self) -> bool: ...

    def ask(self) -> list[Individual]: ...

    def tell(self, scored: Sequence[Scored]) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class CMAESSettings:
    sigma: float = dataclasses.field(
        default=0.2,
        metadata={"help": "Initial step size of CMA-ES, in units of the grid's width (x and y scaled to 1)."},
    )

    def __post_init__(self) -> None:
        if not 0 < self.sigma <= 1:
            raise ValueError(f"CMA-ES sigma must be in (0, 1] (the box is [0, 1] wide), got {self.sigma}.")


# What CMA-ES learns from generation to generation (mean, step size, covariance and its cached
# eigendecomposition, evolution paths, generation). Everything else follows from the settings and
# is rebuilt by the constructor; the random state is reseeded from the generation (see `ask`).
# cmaes offers no state API but pickle, and unpickling a checkpoint could run any code in it.
_CMA_STATE = {"mean": "_mean", "sigma": "_sigma", "C": "_C", "p_sigma": "_p_sigma", "pc": "_pc"}
_CMA_OPTIONAL = {"B": "_B", "D": "_D"}  # None until the next sample needs them


class CMAESSearch:
    """CMA-ES started at Eq. 8's individual, with the GA's population size per generation (at least 4).

    Checkpoints hold its state as plain numbers (JSON), never as a serialised object.
    """

    name = "cmaes"

    def __init__(self, ga: GASettings, num_layers: int, settings: CMAESSettings | None = None) -> None:
        from cmaes import CMA

        self.grid = ga.grid(num_layers)
        self.settings = settings or CMAESSettings()
        dim = 2 * self.grid.control_points
        self.cma = CMA(
            mean=self._encode(self.grid.first_individual(ga.initial_y)),
            sigma=self.settings.sigma,
            bounds=np.array([[0.0, 1.0]] * dim),
            seed=ga.seed,
            # Fewer than 4 samples leave CMA-ES's covariance update degenerate (a zero weight sum).
            population_size=max(ga.population_size, 4),
        )
        self.seed = ga.seed
        self._asked: list[np.ndarray] = []

    @property
    def finished(self) -> bool:
        return False  # runs until the search's budget is spent

    def ask(self) -> list[Individual]:
        if not self._asked:
            # cmaes does not pickle its random state, so each generation draws from its own seed:
            # a search resumed from a checkpoint samples what the uninterrupted one would.
            self.cma.reseed_rng(self.seed * 1_000_003 + self.cma.generation)
            self._asked = [self.cma.ask() for _ in range(self.cma.population_size)]
        return [self._decode(vector) for vector in self._asked]

    def tell(self, scored: Sequence[Scored]) -> None:
        if [ind for ind, _ in scored] != self.ask():
            raise ValueError("tell() needs the fitness of exactly the individuals ask() returned, in order.")
        # cmaes minimises; it learns from the continuous samples it drew.
        self.cma.tell([(vector, -fitness) for vector, (_, fitness) in zip(self._asked, scored, strict=True)])
        self._asked = []

    def _encode(self, individual: Individual) -> np.ndarray:
        xs = [x / (self.grid.num_layers - 1) for x, _ in individual]
        ys = [(y - self.grid.y_min) / (self.grid.y_max - self.grid.y_min) for _, y in individual]
        return np.array(xs + ys)

    def _decode(self, vector: np.ndarray) -> Individual:
        k = self.grid.control_points
        xs = vector[:k] * (self.grid.num_layers - 1)
        ys = self.grid.y_min + vector[k:] * (self.grid.y_max - self.grid.y_min)
        return self.grid.repair(list(zip(xs.tolist(), ys.tolist(), strict=True)))

    def state_dict(self) -> dict[str, Any]:
        cma: dict[str, Any] = {"generation": self.cma.generation}
        for key, attribute in (_CMA_STATE | _CMA_OPTIONAL).items():
            value = getattr(self.cma, attribute)
            cma[key] = None if value is None else np.asarray(value, dtype=float).tolist()
        return {
            "settings": dataclasses.asdict(self.settings),
            "cma": cma,
            "asked": [vector.tolist() for vector in self._asked],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["settings"] != dataclasses.asdict(self.settings):
            raise ValueError(
                "The checkpoint was written with other CMA-ES settings; start a new search folder (--out)."
            )
        cma = state["cma"]
        if not isinstance(cma, dict):
            raise ValueError(
                "The checkpoint holds the CMA-ES state as a pickled object (an older format); it is not "
                "loaded, because unpickling a file can run any code in it. Start a new search folder (--out)."
            )
        dim = self.cma.dim
        shapes = {"mean": (dim,), "sigma": (), "C": (dim, dim), "p_sigma": (dim,), "pc": (dim,)}
        values: dict[str, np.ndarray | None] = {key: _finite_array(cma, key, s) for key, s in shapes.items()}
        for key, shape in {"B": (dim, dim), "D": (dim,)}.items():
            values[key] = None if cma.get(key) is None else _finite_array(cma, key, shape)
        generation = cma.get("generation")
        if not isinstance(generation, int) or generation < 0:
            raise ValueError(
                "The checkpoint's CMA-ES generation is not a count; start a new search folder (--out)."
            )
        for key, attribute in (_CMA_STATE | _CMA_OPTIONAL).items():
            setattr(self.cma, attribute, values[key])
        self.cma._sigma = float(cma["sigma"])  # a number, checked above
        self.cma._g = generation
        self._asked = [np.array(vector) for vector in state["asked"]]


def _finite_array(state: dict[str, Any], key: str, shape: tuple[int, ...]) -> np.ndarray:
    try:
        value = np.array(state[key], dtype=float)
    except (KeyError, TypeError, ValueError):
        value = None
    if value is None or value.shape != shape or not np.isfinite(value).all():
        raise ValueError(
            f"The checkpoint's CMA-ES state has no valid '{key}' (finite numbers of shape {shape}); "
            "start a new search folder (--out)."
        )
    return value


class RandomSearch:
    """Uniform valid individuals, never the same one twice, the GA's population size at a time."""

    name = "random"

    def __init__(self, ga: GASettings, num_layers: int) -> None:
        self.grid = ga.grid(num_layers)
        self.population_size = ga.population_size
        self.rng = random.Random(ga.seed)
        self.seen: set[Individual] = set()
        self._pending: list[Individual] = []

    @property
    def finished(self) -> bool:
        return False  # runs until the search's budget is spent

    def ask(self) -> list[Individual]:
        if not self._pending:
            for _ in range(50 * self.population_size):
                if len(self._pending) == self.population_size:
                    break
                individual = self.grid.random_individual(self.rng)
                if individual not in self.seen:
                    self.seen.add(individual)
                    self._pending.append(individual)
        return list(self._pending)

    def tell(self, scored: Sequence[Scored]) -> None:
        self._pending = []

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {
            "rng": [version, list(internal), gauss],
            "seen": sorted([[x, y] for x, y in ind] for ind in self.seen),
            "pending": [[[x, y] for x, y in ind] for ind in self._pending],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.seen = {from_json(ind) for ind in state["seen"]}
        self._pending = [from_json(ind) for ind in state["pending"]]


def make_optimizer(
    name: str, ga: GASettings, num_layers: int, cmaes: CMAESSettings | None = None
) -> Optimizer:
    """An optimiser by name ("ga", "cmaes", "random") over the grid of `ga`."""
    if name == "ga":
        return BezierGA(ga, num_layers)
    if name == "cmaes":
        return CMAESSearch(ga, num_layers, cmaes)
    if name == "random":
        return RandomSearch(ga, num_layers)
    raise ValueError(f"Unknown optimiser {name!r}; choose from {', '.join(OPTIMIZERS)}.")
