"""The constrained genetic algorithm of the layer-specific scaling paper (Section 3.3, Algorithm 1).

An individual is a Bezier curve over layer index, given by its control points on the paper's
grid (Table 1): x an integer layer index in [0, n - 1], y a factor in [y_min, y_max] in steps
of y_step. The curve gives one RoPE interpolation factor per layer (`rag_mspoe.rope.bezier`).

    ga = BezierGA(GASettings(seed=0), num_layers=30)
    while not ga.finished:
        population = ga.ask()
        ga.tell([(individual, fitness(individual)) for individual in population])
    best, score = ga.best

The algorithm is pure and deterministic by seed: it never calls a model, and its whole state
(`state_dict`) is plain JSON, so a search can be checkpointed after every generation.

Eq. 10 as printed clamps with min/max the wrong way round ([min(0, x - N_x), ...] would allow
negative x); we read it as intended: a coordinate moves by at most its amplitude and stays
inside the grid and between its neighbours, which keeps Eq. 9.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

Point = tuple[int, float]
Individual = tuple[Point, ...]
Scored = tuple[Individual, float]


def _setting(default: Any, text: str) -> Any:
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class GASettings:
    """Every hyperparameter of the search space and of Algorithm 1; defaults follow the paper where it
    gives a value and are sized for a small CPU search where it does not."""

    control_points: int = _setting(4, "Bezier control points (degree + 1); the paper uses a cubic curve, 4.")
    y_min: float = _setting(1.0, "Smallest factor a control point may take (Table 1: 1.0).")
    y_max: float = _setting(2.0, "Largest factor a control point may take (Table 1: 2.0).")
    y_step: float = _setting(0.1, "Grid step of the factors (Table 1: 0.1).")
    initial_y: float = _setting(1.5, "Factor of every control point of the first individual (Eq. 8: 1.5).")
    population_size: int = _setting(6, "Individuals in the first population (P).")
    generations: int = _setting(4, "Populations evaluated (T, the iterations of Algorithm 1).")
    top_k: int = _setting(2, "Best individuals kept from one generation to the next (elitism).")
    mutation_size: int = _setting(3, "Mutants made from the top-k in each generation (N1).")
    crossover_size: int = _setting(1, "Children made by crossover of top-k pairs in each generation (N2).")
    mutation_probability: float = _setting(0.5, "Chance that a mutation moves each coordinate (p).")
    crossover_probability: float = _setting(
        0.5, "Chance that a child takes a control point from its 2nd parent."
    )
    amplitude_x: int = _setting(3, "Largest move of a control point's layer index in one mutation (N_x).")
    amplitude_y: float = _setting(0.2, "Largest move of a control point's factor in one mutation (N_y).")
    seed: int = _setting(0, "Seed of the search's random numbers; the same seed gives the same search.")

    def __post_init__(self) -> None:
        if self.control_points < 2:
            raise ValueError(f"control_points must be at least 2, got {self.control_points}.")
        if not 0 < self.y_step <= self.y_max - self.y_min:
            raise ValueError(
                f"y_step ({self.y_step}) must be positive and fit in "
                f"[y_min, y_max] = [{self.y_min}, {self.y_max}]."
            )
        if self.y_min <= 0:
            raise ValueError(f"y_min must be positive (a factor divides positions), got {self.y_min}.")
        if not self.y_min <= self.initial_y <= self.y_max:
            raise ValueError(f"initial_y ({self.initial_y}) must lie in [y_min, y_max].")
        for name in ("population_size", "generations", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.mutation_size < 0 or self.crossover_size < 0 or self.mutation_size + self.crossover_size < 1:
            raise ValueError("mutation_size and crossover_size must be >= 0, and at least one of them > 0.")
        for name in ("mutation_probability", "crossover_probability"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}.")
        if self.amplitude_x < 1 or self.amplitude_y < self.y_step:
            raise ValueError(
                "amplitude_x must be at least 1 and amplitude_y at least y_step, or nothing moves."
            )

    def grid(self, num_layers: int) -> Grid:
        return Grid(num_layers, self.control_points, self.y_min, self.y_max, self.y_step)


@dataclass(frozen=True)
class Grid:
    """The search space (Table 1): control points with integer x in [0, n - 1] and y on a grid."""

    num_layers: int
    control_points: int
    y_min: float
    y_max: float
    y_step: float

    def __post_init__(self) -> None:
        if self.num_layers < self.control_points:
            raise ValueError(
                f"{self.control_points} control points need strictly increasing layer indices, but the "
                f"model has only {self.num_layers} layers; use fewer control points."
            )

    @property
    def y_values(self) -> list[float]:
        count = int(round((self.y_max - self.y_min) / self.y_step)) + 1
        return [round(self.y_min + i * self.y_step, 10) for i in range(count)]

    def snap_y(self, y: float) -> float:
        """The grid factor nearest `y` (clipped to [y_min, y_max])."""
        return min(self.y_values, key=lambda value: abs(value - y))

    def first_individual(self, initial_y: float) -> Individual:
        """Eq. 8: x evenly spaced over [0, n - 1], every y the same."""
        last = self.control_points - 1
        y = self.snap_y(initial_y)
        return tuple((round((self.num_layers - 1) * i / last), y) for i in range(self.control_points))

    def is_valid(self, individual: Individual) -> bool:
        """On the grid, with the right number of points and x strictly increasing (Eq. 9)."""
        if len(individual) != self.control_points:
            return False
        xs = [x for x, _ in individual]
        on_grid = all(isinstance(x, int) and 0 <= x < self.num_layers for x in xs) and all(
            y in self.y_values for _, y in individual
        )
        return on_grid and all(a < b for a, b in zip(xs, xs[1:], strict=False))

    def repair(self, points: Sequence[tuple[float, float]]) -> Individual:
        """The valid individual nearest free (x, y) points: sorted by x, snapped to the grid, and
        pushed apart where two land on the same layer (for optimisers that work in continuous space)."""
        ordered = sorted(points, key=lambda p: p[0])
        xs = [min(max(int(round(x)), 0), self.num_layers - 1) for x, _ in ordered]
        for i in range(1, len(xs)):
            xs[i] = max(xs[i], xs[i - 1] + 1)
        xs[-1] = min(xs[-1], self.num_layers - 1)
        for i in range(len(xs) - 2, -1, -1):
            xs[i] = min(xs[i], xs[i + 1] - 1)
        return tuple((x, self.snap_y(y)) for x, (_, y) in zip(xs, ordered, strict=True))

    def random_individual(self, rng: random.Random) -> Individual:
        xs = sorted(rng.sample(range(self.num_layers), self.control_points))
        return tuple((x, rng.choice(self.y_values)) for x in xs)


def mutate(parent: Individual, grid: Grid, settings: GASettings, rng: random.Random) -> Individual:
    """Bounded mutation (Eq. 10): each coordinate moves with probability p, x by at most N_x and
    never past its neighbours, y by at most N_y and inside [y_min, y_max]."""
    child: list[Point] = []
    last = len(parent) - 1
    for i, (x, y) in enumerate(parent):
        if rng.random() < settings.mutation_probability:
            low = 0 if i == 0 else child[i - 1][0] + 1  # left of the already-moved neighbour
            high = grid.num_layers - 1 if i == last else parent[i + 1][0] - 1
            x = rng.randint(max(low, x - settings.amplitude_x), min(high, x + settings.amplitude_x))
        if rng.random() < settings.mutation_probability:
            near = [v for v in grid.y_values if abs(v - y) <= settings.amplitude_y + 1e-9]
            y = rng.choice(near)
        child.append((x, y))
    return tuple(child)


def crossover(
    parents: Sequence[Individual],
    count: int,
    grid: Grid,
    settings: GASettings,
    rng: random.Random,
    seen: set[Individual],
) -> tuple[list[Individual], int]:
    """Crossover with constraint: `count` children, each taking every control point from one of two
    parents picked from `parents`. A child that breaks Eq. 9 or repeats a known individual is
    dropped and a new pair is picked, up to 2 x count times. Returns (children, retries used)."""
    children: list[Individual] = []
    retries = 0
    if len({*parents}) < 2:
        return children, retries
    while len(children) < count and retries < 2 * count:
        first, second = rng.sample(list(parents), 2)
        child = tuple(
            b if rng.random() < settings.crossover_probability else a
            for a, b in zip(first, second, strict=True)
        )
        if grid.is_valid(child) and child not in seen:
            children.append(child)
            seen.add(child)
        else:
            retries += 1
    return children, retries


class BezierGA:
    """Algorithm 1 as ask/tell: `ask` gives the population to evaluate, `tell` takes its fitness."""

    name = "ga"

    def __init__(self, settings: GASettings, num_layers: int) -> None:
        self.settings = settings
        self.grid = settings.grid(num_layers)
        self.rng = random.Random(settings.seed)
        self.generation = 0
        self.top: list[Scored] = []
        self.seen: set[Individual] = set()
        self.crossover_retries: list[int] = []
        self.pending = self._initial_population()

    @property
    def finished(self) -> bool:
        return self.generation >= self.settings.generations

    @property
    def best(self) -> Scored:
        if not self.top:
            raise RuntimeError("No generation has been evaluated yet; call tell() first.")
        return self.top[0]

    def ask(self) -> list[Individual]:
        return list(self.pending)

    def tell(self, scored: Sequence[Scored]) -> None:
        """Update the top-k with the evaluated population and breed the next one."""
        if sorted(ind for ind, _ in scored) != sorted(self.pending):
            raise ValueError("tell() needs the fitness of exactly the individuals ask() returned.")
        self.top = self._update_top(scored)
        self.generation += 1
        if not self.finished:
            self.pending = self._next_population()

    # -- Algorithm 1, lines 2 and 5-8 -------------------------------------------------------------
    def _initial_population(self) -> list[Individual]:
        """Eq. 8's individual, and mutants of it until the population is full."""
        first = self.grid.first_individual(self.settings.initial_y)
        population = [first]
        self.seen.add(first)
        population += self._mutants([first], self.settings.population_size - 1)
        return population

    def _update_top(self, scored: Sequence[Scored]) -> list[Scored]:
        """The best k of the previous top-k and the new population; incumbents win ties."""
        merged: dict[Individual, float] = {}
        for individual, fitness in [*self.top, *scored]:
            merged.setdefault(individual, fitness)
        ranked = sorted(merged.items(), key=lambda item: -item[1])  # stable: earlier first among equals
        return ranked[: self.settings.top_k]

    def _next_population(self) -> list[Individual]:
        elite = [individual for individual, _ in self.top]
        mutants = self._mutants(elite, self.settings.mutation_size)
        children, retries = crossover(
            elite, self.settings.crossover_size, self.grid, self.settings, self.rng, self.seen
        )
        self.crossover_retries.append(retries)
        return mutants + children + elite

    def _mutants(self, parents: Sequence[Individual], count: int) -> list[Individual]:
        """`count` new individuals, each a mutant of a random parent; a mutant equal to a known
        individual is drawn again (a bounded number of times: a tiny grid may run out)."""
        mutants: list[Individual] = []
        for _ in range(50 * count):
            if len(mutants) == count:
                break
            child = mutate(self.rng.choice(list(parents)), self.grid, self.settings, self.rng)
            if child not in self.seen:
                self.seen.add(child)
                mutants.append(child)
        return mutants

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {
            "settings": dataclasses.asdict(self.settings),
            "num_layers": self.grid.num_layers,
            "generation": self.generation,
            "rng": [version, list(internal), gauss],
            "top": [[_to_json(ind), fitness] for ind, fitness in self.top],
            "seen": sorted(_to_json(ind) for ind in self.seen),
            "pending": [_to_json(ind) for ind in self.pending],
            "crossover_retries": self.crossover_retries,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (
            state["settings"] != dataclasses.asdict(self.settings)
            or state["num_layers"] != self.grid.num_layers
        ):
            raise ValueError(
                "The checkpoint was written by a GA with other settings; start a new search folder (--out)."
            )
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.generation = state["generation"]
        self.top = [(from_json(ind), float(fitness)) for ind, fitness in state["top"]]
        self.seen = {from_json(ind) for ind in state["seen"]}
        self.pending = [from_json(ind) for ind in state["pending"]]
        self.crossover_retries = list(state["crossover_retries"])


def _to_json(individual: Individual) -> list[list[float]]:
    return [[x, y] for x, y in individual]


def from_json(points: Sequence[Sequence[float]]) -> Individual:
    """An individual from its JSON form ([[x, y], ...])."""
    return tuple((int(x), float(y)) for x, y in points)


def individual_key(individual: Individual) -> str:
    """A short stable text for an individual: '0:1.5|10:1.5|19:1.5|29:1.5'."""
    return "|".join(f"{x}:{y:g}" for x, y in individual)
