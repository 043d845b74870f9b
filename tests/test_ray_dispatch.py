"""Which unit a Ray worker scores next: in plan order, but the other labels of a sweep's examples go
to the worker that read those examples first, whose caches hold their documents."""

from __future__ import annotations

from collections import deque

from rag_mspoe.eval.runs.ray_backend import Dispatcher
from rag_mspoe.eval.sweep.plan import plan_batches
from rag_mspoe.eval.sweep.run import Sweep

LABELS = ["none", "invariant-reorder", "invariant-reorder:10"]


def run(dispatcher, workers=2, in_flight=2):
    """Workers take `in_flight` units each, then in turn finish their oldest and take another;
    returns (worker, unit) in the order the units were taken."""
    taken, held = [], [deque() for _ in range(workers)]

    def take(worker):
        unit = dispatcher.take(worker)
        if unit is not None:
            taken.append((worker, unit))
            held[worker].append(unit)

    for worker in range(workers):
        for _ in range(in_flight):
            take(worker)
    turn = 0
    while any(held):
        worker = turn % workers
        turn += 1
        if held[worker]:
            held[worker].popleft()
            take(worker)
    return taken


def examples_of(batch):
    return Sweep.shared_work(Sweep.__new__(Sweep), batch)


def test_every_label_of_a_batchs_examples_goes_to_one_worker_in_plan_order_of_examples():
    units = list(plan_batches(16, LABELS, (0, 9, 19), batch_size=8))
    taken = run(Dispatcher(units, workers=2, shared_work=examples_of))
    assert sorted(map(id, (unit for _, unit in taken))) == sorted(map(id, units))  # each once
    workers_of: dict[frozenset[int], set[int]] = {}
    for worker, unit in taken:
        workers_of.setdefault(examples_of(unit), set()).add(worker)
    assert all(len(workers) == 1 for workers in workers_of.values()), workers_of
    # The examples are started in the plan's order: every first label of two examples comes
    # before the first of the later ones.
    started = list(dict.fromkeys(examples_of(unit) for _, unit in taken))
    assert started == list(dict.fromkeys(examples_of(unit) for unit in units))


def test_units_that_share_nothing_go_in_plan_order():
    units = list(plan_batches(16, LABELS, (0, 9, 19), batch_size=8))
    assert [unit for _, unit in run(Dispatcher(units, workers=2))] == units
    assert Dispatcher([], workers=1).take(0) is None
