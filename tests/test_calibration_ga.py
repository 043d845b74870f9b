"""The constrained Bezier GA of the layer-specific scaling paper, and the optimisers compared with it,
on cheap synthetic fitness functions: no model involved."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from rag_mspoe.eval.settings_search.bezier_ga import BezierGA, GASettings, crossover, individual_key, mutate
from rag_mspoe.eval.settings_search.fitness import FitnessWeights
from rag_mspoe.eval.settings_search.optimizers import make_optimizer
from rag_mspoe.rope.bezier import bezier_layer_factors

LAYERS = 30
TARGET = bezier_layer_factors([(0, 1.0), (8, 2.0), (20, 1.9), (29, 1.1)], LAYERS)


def closeness(individual) -> float:
    """Synthetic fitness: minus the squared distance of the curve's factors from a target curve."""
    factors = bezier_layer_factors(individual, LAYERS)
    return -sum((a - b) ** 2 for a, b in zip(factors, TARGET, strict=True))


def run(optimizer, fitness, budget=None, generations=None):
    """Ask/tell until the optimiser finishes, `generations` were told, or `budget` distinct
    individuals were evaluated. Returns (fitness of every individual evaluated, populations told)."""
    evaluated: dict = {}
    asked: list = []
    while not optimizer.finished and (budget is None or len(evaluated) < budget):
        if generations is not None and len(asked) == generations:
            break
        population = optimizer.ask()
        new = [ind for ind in dict.fromkeys(population) if ind not in evaluated]
        if budget is not None and len(evaluated) + len(new) > budget:
            for ind in new[: budget - len(evaluated)]:
                evaluated[ind] = fitness(ind)
            break
        for ind in new:
            evaluated[ind] = fitness(ind)
        asked.append(population)
        optimizer.tell([(ind, evaluated[ind]) for ind in population])
    return evaluated, asked


def test_first_individual_follows_eq8():
    assert BezierGA(GASettings(), LAYERS).ask()[0] == ((0, 1.5), (10, 1.5), (19, 1.5), (29, 1.5))
    three = GASettings(control_points=3, initial_y=1.2).grid(11).first_individual(1.2)
    assert three == ((0, 1.2), (5, 1.2), (10, 1.2))


@pytest.mark.parametrize("name", ["ga", "cmaes", "random"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_individual_is_on_the_grid_with_increasing_x(name, seed):
    settings = GASettings(seed=seed, generations=6, population_size=8, amplitude_x=6, amplitude_y=0.5)
    grid = settings.grid(12)
    noise = random.Random(seed)
    optimizer = make_optimizer(name, settings, 12)
    _, asked = run(optimizer, lambda ind: noise.random(), budget=60)
    individuals = [ind for population in asked for ind in population]
    assert len(individuals) >= 30
    for individual in individuals:
        assert grid.is_valid(individual), individual
        xs = [x for x, _ in individual]
        assert all(a < b for a, b in zip(xs, xs[1:], strict=False))  # Eq. 9
        assert all(1.0 <= y <= 2.0 and round(y * 10) == pytest.approx(y * 10) for _, y in individual)


def test_mutation_moves_each_coordinate_at_most_its_amplitude():
    settings = GASettings(amplitude_x=2, amplitude_y=0.3, mutation_probability=1.0)
    grid = settings.grid(LAYERS)
    rng = random.Random(0)
    moved_x = moved_y = 0
    for _ in range(500):
        parent = grid.random_individual(rng)
        child = mutate(parent, grid, settings, rng)
        assert grid.is_valid(child)
        for (x, y), (cx, cy) in zip(parent, child, strict=True):
            assert abs(cx - x) <= 2
            assert abs(cy - y) <= 0.3 + 1e-9
            moved_x += cx != x
            moved_y += cy != y
    assert moved_x > 500 and moved_y > 500  # the bounds are used, not only respected


def test_mutation_probability_is_per_coordinate():
    settings = GASettings(mutation_probability=0.1)
    grid = settings.grid(LAYERS)
    rng = random.Random(1)
    parent = grid.first_individual(1.5)
    unchanged = sum(mutate(parent, grid, settings, rng) == parent for _ in range(1000))
    # Eight coordinates each stay with probability >= 0.9: at least 0.9**8 = 43% stay whole.
    assert 380 < unchanged < 700


def test_crossover_takes_each_point_from_a_parent_and_keeps_eq9():
    settings = GASettings(control_points=2, crossover_probability=0.5)
    grid = settings.grid(10)
    first = ((5, 1.0), (6, 1.0))
    second = ((2, 2.0), (3, 2.0))
    rng = random.Random(0)
    retries_seen = 0
    for _ in range(200):
        seen = {first, second}
        children, retries = crossover([first, second], 1, grid, settings, rng, seen)
        assert retries <= 2
        retries_seen += retries
        for child in children:
            # (5, 3) breaks Eq. 9 and the parents themselves are known: only (2, 6) is new and valid.
            assert child == ((2, 2.0), (6, 1.0))
            assert child in seen
    assert retries_seen > 0


def test_crossover_gives_up_after_2_n2_retries():
    settings = GASettings(control_points=2)
    grid = settings.grid(10)
    first, second = ((0, 1.0), (5, 1.0)), ((0, 2.0), (5, 2.0))
    every_mix = {((0, a), (5, b)) for a in (1.0, 2.0) for b in (1.0, 2.0)}
    children, retries = crossover([first, second], 3, grid, settings, random.Random(0), set(every_mix))
    assert children == [] and retries == 6


def test_elitism_keeps_the_best_individual_ever_evaluated():
    ga = BezierGA(GASettings(seed=3, generations=6), LAYERS)
    noise = random.Random(3)
    history: dict = {}
    while not ga.finished:
        population = ga.ask()
        scores = {ind: history.get(ind, noise.random()) for ind in population}
        history.update(scores)
        ga.tell(list(scores.items()))
        best = max(history, key=history.get)
        assert ga.best == (best, history[best])
        if not ga.finished:
            assert best in ga.ask()  # the top-k go on into the next population
            assert len(ga.ask()) == len(set(ga.ask()))


def test_same_seed_gives_the_same_search_and_another_seed_another():
    def trace(seed):
        return run(BezierGA(GASettings(seed=seed), LAYERS), closeness)[1]

    assert trace(5) == trace(5)
    assert trace(5) != trace(6)


@pytest.mark.parametrize("name", ["ga", "cmaes", "random"])
def test_a_checkpointed_optimizer_continues_as_if_never_stopped(name):
    settings = GASettings(seed=2, generations=5)
    _, whole = run(make_optimizer(name, settings, LAYERS), closeness, generations=5)

    first = make_optimizer(name, settings, LAYERS)
    _, before = run(first, closeness, generations=2)
    state = json.loads(json.dumps(first.state_dict()))  # through JSON, as a checkpoint file
    second = make_optimizer(name, settings, LAYERS)
    second.load_state_dict(state)
    _, after = run(second, closeness, generations=3)
    assert len(whole) == 5
    assert before + after == whole


def test_a_cmaes_checkpoint_taken_between_ask_and_tell_is_plain_json_and_resumes_exactly():
    settings = GASettings(seed=3, generations=5)
    _, whole = run(make_optimizer("cmaes", settings, LAYERS), closeness, generations=4)

    first = make_optimizer("cmaes", settings, LAYERS)
    _, before = run(first, closeness, generations=2)
    first.ask()  # mid-generation: the samples and their eigendecomposition are cached
    text = json.dumps(first.state_dict(), allow_nan=False)
    assert set(json.loads(text)["cma"]) == {"generation", "mean", "sigma", "C", "p_sigma", "pc", "B", "D"}
    second = make_optimizer("cmaes", settings, LAYERS)
    second.load_state_dict(json.loads(text))
    _, after = run(second, closeness, generations=2)
    assert before + after == whole


class _Payload:
    """What a hostile checkpoint pickles: unpickling it opens (creates) a file."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickled_cmaes_state_is_refused_without_being_unpickled(tmp_path):
    import base64
    import pickle

    optimizer = make_optimizer("cmaes", GASettings(seed=3), LAYERS)
    state = json.loads(json.dumps(optimizer.state_dict()))
    state["cma"] = base64.b64encode(pickle.dumps(_Payload(tmp_path / "ran"))).decode("ascii")
    with pytest.raises(ValueError, match="pickled object .* unpickling a file can run any code"):
        optimizer.load_state_dict(state)
    assert not (tmp_path / "ran").exists()

    state = json.loads(json.dumps(optimizer.state_dict()))
    state["cma"]["C"] = [[1.0, 0.0]]
    with pytest.raises(ValueError, match="no valid 'C'"):
        optimizer.load_state_dict(state)


def test_ga_finds_a_target_curve_better_than_random_search_at_the_same_budget():
    settings = GASettings(population_size=6, generations=8, top_k=2, mutation_size=3, crossover_size=1)
    ga_best, random_best = [], []
    for seed in range(8):
        settings_seed = dataclasses.replace(settings, seed=seed)
        evaluated, _ = run(BezierGA(settings_seed, LAYERS), closeness)
        ga_best.append(max(evaluated.values()))
        baseline, _ = run(make_optimizer("random", settings_seed, LAYERS), closeness, budget=len(evaluated))
        assert len(baseline) == len(evaluated)
        random_best.append(max(baseline.values()))
    wins = sum(g > r for g, r in zip(ga_best, random_best, strict=True))
    assert wins >= 6, (ga_best, random_best)
    assert sum(ga_best) > sum(random_best)


def test_settings_refuse_what_the_paper_rules_out():
    with pytest.raises(ValueError, match="Eq. 12"):
        FitnessWeights(0.5, 0.3, 0.2)
    with pytest.raises(ValueError, match="Eq. 12"):
        FitnessWeights.parse("0.3,0.3,0.4")
    assert FitnessWeights.parse("0.1,0.2,0.7") == FitnessWeights(0.1, 0.2, 0.7)
    with pytest.raises(ValueError, match="initial_y"):
        GASettings(initial_y=2.5)
    with pytest.raises(ValueError, match="fewer control points"):
        GASettings(control_points=5).grid(4)


def test_individual_keys_are_short_and_distinct():
    assert individual_key(((0, 1.5), (29, 1.2))) == "0:1.5|29:1.2"
    assert individual_key(((0, 1.5), (29, 1.2))) != individual_key(((0, 1.5), (28, 1.2)))
