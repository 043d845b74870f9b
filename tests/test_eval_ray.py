"""A sweep fanned out over a local Ray with two workers writes the records a local run writes."""

from __future__ import annotations

import pytest
from eval_run_helpers import save_tiny_chat_model

from rag_mspoe.eval.runs.results import read_records
from rag_mspoe.eval.sweep.plan import SweepConfig
from rag_mspoe.eval.sweep.run import run_sweep

pytest.importorskip("ray")


def test_two_ray_workers_write_the_same_records_as_one_process(tmp_path):
    model_dir = save_tiny_chat_model(tmp_path / "model")
    config = SweepConfig(
        num_documents=5,
        positions=(0, 4),
        methods=("none", "mspoe", "dynamic-ntk"),
        samples=2,
        batch_size=2,
        model=str(model_dir),
    )
    on_ray = run_sweep(
        config, tmp_path / "ray", ray_address="local", ray_workers=2, threads=1, progress=False
    )
    local = run_sweep(config, tmp_path / "local", threads=1, progress=False, report=False)
    assert on_ray.complete and local.complete

    def by_key(folder):
        records = read_records(folder / "results.jsonl")
        return {(r["method"], r["position"], r["example_id"]): r for r in records}

    ray_records, local_records = by_key(tmp_path / "ray"), by_key(tmp_path / "local")
    assert len(ray_records) == len(local_records) == 3 * 2 * 2
    assert ray_records.keys() == local_records.keys()
    for key, record in local_records.items():
        assert ray_records[key]["choice"] == record["choice"]
        assert ray_records[key]["gold_logprob"] == pytest.approx(record["gold_logprob"], abs=1e-4)
    assert (tmp_path / "ray" / "table.md").is_file()


def test_ray_needs_at_least_one_worker(tmp_path):
    config = SweepConfig(num_documents=3, positions=(0,), samples=1, model=str(tmp_path))
    with pytest.raises(ValueError, match="at least 1"):
        run_sweep(config, tmp_path / "run", ray_address="local", ray_workers=0, progress=False)


class _CrashingScoring:
    """An evaluation whose worker process dies on its first unit, as when memory runs out."""

    def __init__(self, model: str) -> None:
        self.config = type("Config", (), {"model": model})()

    def scorer(self, model, tokenizer):
        import os

        return lambda unit: os._exit(1)


def test_a_lost_worker_stops_the_run_with_what_to_do(tmp_path):
    import sys

    from ray import cloudpickle

    from rag_mspoe.eval.runs.ray_backend import WorkerPool

    # The worker cannot import this test module: the crashing evaluation travels by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    model_dir = save_tiny_chat_model(tmp_path / "model")
    expected = pytest.raises(RuntimeError, match="rerun the same command to go on")
    with WorkerPool(_CrashingScoring(str(model_dir)), "local", 1, threads=1) as pool, expected as caught:
        list(pool.map(["unit"]))
    assert "A Ray worker was lost" in str(caught.value) and "--ray-workers" in str(caught.value)
