"""Layer-factor calibration end to end: fitness through the engine on a tiny random Llama (with the
real SmolLM2 tokenizer), a `calibrate` process killed mid-search and resumed, the heads and hidden
subcommands, Ray workers, and one very small search on the real embedded model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model

from rag_mspoe import LayerWise, MsPoE, Uniform, load_method, load_model, rescale, unrescale
from rag_mspoe.cli import main
from rag_mspoe.engine import Engine
from rag_mspoe.eval.scoring.model_scores import score_forced_choice
from rag_mspoe.eval.settings_search.fitness import (
    CalibrationSplit,
    FitnessCache,
    FitnessWeights,
    LocalEvaluator,
    evaluate_cached,
    utility,
)

SEARCH = [
    "calibrate", "layers", "--threads", "1", "--documents", "4", "--examples", "3", "--heldout-examples", "1",
    "--optimizers", "ga,cmaes", "--population-size", "3", "--generations", "3", "--mutation-size", "2",
    "--crossover-size", "1", "--top-k", "1",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_engine(embedded):
    tokenizer = embedded[1]
    # Large random weights give sharp attention, so rescaled positions change the scores.
    model = tiny_model(
        "llama", vocab_size=len(tokenizer), max_position_embeddings=1024, initializer_range=0.3
    )
    return Engine(model, tokenizer, name="tiny-llama")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tiny_engine):
    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    tiny_engine.model.save_pretrained(folder)
    tiny_engine.tokenizer.save_pretrained(folder)
    return folder


class CountingEvaluator:
    """A real evaluator that also counts the methods it was asked to score."""

    def __init__(self, inner):
        self.inner, self.split, self.model_name = inner, inner.split, inner.model_name
        self.scored = 0

    def evaluate(self, methods):
        self.scored += len(methods)
        yield from self.inner.evaluate(methods)


def test_fitness_scores_each_position_and_the_cache_spares_every_repeat(tiny_engine, tmp_path):
    split = CalibrationSplit(num_documents=4, num_examples=3, seed=5)
    assert split.positions == {"first": 0, "middle": 1, "last": 3}
    evaluator = CountingEvaluator(LocalEvaluator(tiny_engine, split, progress=False))
    cache = FitnessCache(tmp_path / "cache.jsonl")
    curve = LayerWise(control_points=[(0, 1.0), (3, 2.0)])
    methods = [None, Uniform(2.0), curve, Uniform(2.0)]
    scores = evaluate_cached(evaluator, cache, methods)
    assert evaluator.scored == 3  # the repeated method is scored once
    assert scores[1] == scores[3]
    assert scores[0].probability != scores[1].probability != scores[2].probability

    # The per-position averages are those of forced choice run prompt by prompt.
    items = split.items()
    assert len(items) == 9 and {item.position for item in items} == {"first", "middle", "last"}
    for position in ("first", "middle", "last"):
        picks = [
            score_forced_choice(tiny_engine, item.prompt, item.candidates, item.gold, method="none")
            for item in items
            if item.position == position
        ]
        assert scores[0].accuracy[position] == pytest.approx(sum(p["correct"] for p in picks) / 3)
        assert 0 < scores[0].probability[position] < 1
        assert scores[0].loglik[position] < 0
    a = scores[2].accuracy
    assert utility(scores[2], FitnessWeights(0.2, 0.3, 0.5), "choice") == pytest.approx(
        0.2 * a["first"] + 0.3 * a["middle"] + 0.5 * a["last"]
    )

    # The cache is on disk: a new process (here a new cache object) scores nothing again,
    # and the half-written last line of a killed writer is skipped.
    with (tmp_path / "cache.jsonl").open("a") as handle:
        handle.write('{"key": "0123", "sco')
    again = evaluate_cached(evaluator, FitnessCache(tmp_path / "cache.jsonl"), methods)
    assert evaluator.scored == 3
    assert again == scores


# Fitness of fixed methods on the tiny model, as computed before fitness scored through the
# sweep's scorer: (accuracy, probability, loglik), each per first, middle and last position.
PINNED_FITNESS = {
    "qa": [
        ([0.0, 0.0, 0.3333333], [0.1503869, 0.1283926, 0.2487640], [-14.7568995, -14.1595519, -14.0640446]),
        (
            [0.6666667, 0.0, 0.6666667],
            [0.3397800, 0.1101295, 0.3192738],
            [-13.6547794, -14.6581338, -13.6623472],
        ),
        ([0.0, 0.0, 0.3333333], [0.1199103, 0.0856339, 0.2739826], [-15.6445227, -14.9113448, -14.2419284]),
    ],
    "kv": [
        ([0.5, 0.0, 0.0], [0.3622844, 0.2079165, 0.2138724], [-13.2039733, -13.2632484, -13.3159423]),
        ([1.0, 0.5, 0.0], [0.4812795, 0.4220877, 0.1971443], [-13.7823610, -13.9734378, -14.3462534]),
        ([0.5, 0.0, 0.0], [0.5122837, 0.2549010, 0.3784068], [-12.6669798, -13.0280528, -12.5327973]),
    ],
}


@pytest.mark.parametrize(
    "split",
    [
        CalibrationSplit(num_documents=4, num_examples=3, seed=5),
        CalibrationSplit(task="kv", num_documents=3, num_examples=2, seed=2),
    ],
    ids=["qa", "kv"],
)
def test_fitness_values_stay_what_they_were(tiny_engine, split):
    methods = [None, Uniform(2.0), LayerWise(control_points=[(0, 1.0), (3, 2.0)])]
    scores = dict(LocalEvaluator(tiny_engine, split, progress=False).evaluate(methods))
    for index, expected in enumerate(PINNED_FITNESS[split.task]):
        got = scores[index]
        for values, pinned in zip((got.accuracy, got.probability, got.loglik), expected, strict=True):
            assert [values[p] for p in ("first", "middle", "last")] == pytest.approx(pinned, abs=1e-5)


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def test_calibrate_refuses_a_checkpoint_that_carries_a_pickle(tiny_folder, tmp_path):
    import base64
    import pickle

    out = tmp_path / "foreign"
    ran = tmp_path / "payload-ran"
    search = [arg if arg != "ga,cmaes" else "cmaes" for arg in SEARCH]
    command = [sys.executable, "-m", "rag_mspoe.cli", *search, "--model", str(tiny_folder), "--out", str(out)]
    assert subprocess.run(command, capture_output=True, timeout=300).returncode == 0  # a search's folder
    # An old-style checkpoint whose "CMA-ES object" opens a file when unpickled.
    payload = pickle.dumps(_OpensAFile(str(ran)))
    (out / "cmaes" / "checkpoint.json").write_text(
        json.dumps(
            {
                "optimizer_name": "cmaes",
                "budget": 9,  # population 3 x 3 generations, as SEARCH asks
                "done": False,
                "wall_s": 0.0,
                "evaluated": [],
                "history": [],
                "optimizer": {
                    "settings": {"sigma": 0.2},
                    "cma": base64.b64encode(payload).decode("ascii"),
                    "asked": [],
                },
            }
        )
    )

    result = subprocess.run(command, capture_output=True, text=True, timeout=300)

    assert result.returncode == 1
    assert "holds the CMA-ES state as a pickled object" in result.stderr
    assert "Start a new search folder" in result.stderr
    assert not ran.exists()


class _OpensAFile:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_killed_calibrate_command_resumes_where_it_stopped(tiny_folder, tmp_path, capsys):
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "rag_mspoe.cli", *SEARCH, "--model", str(tiny_folder), "--out", str(out)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cache_file = out / "fitness_cache.jsonl"
    deadline = time.monotonic() + 240
    # Kill it mid-generation: a checkpoint is written and the next generation has begun.
    while True:
        assert process.poll() is None, f"the search ended before it could be killed: {process.stderr.read()}"
        assert time.monotonic() < deadline, "no checkpoint within 240 s"
        states = [read_json(out / name / "checkpoint.json") for name in ("ga", "cmaes")]
        state = next((s for s in reversed(states) if s), None)
        cached = len(cache_file.read_text().splitlines()) if cache_file.is_file() else 0
        evaluated = sum(len(s["evaluated"]) for s in states if s)
        if state and not state["done"] and cached > evaluated:
            break
        time.sleep(0.01)
    process.kill()
    process.communicate()
    stopped_after = len(state["history"]) - 1

    resumed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{state['optimizer_name']}: resuming after generation {stopped_after}" in resumed.stderr
    keys = [json.loads(line)["key"] for line in cache_file.read_text().splitlines()]
    assert len(keys) == len(set(keys)), "an individual was evaluated twice"

    # The same search never killed ends with the same evaluations, history and pick.
    reference = tmp_path / "whole"
    assert main([*SEARCH, "--model", str(tiny_folder), "--out", str(reference)]) == 0
    for name in ("ga", "cmaes"):
        killed, whole = (
            read_json(out / name / "checkpoint.json"),
            read_json(reference / name / "checkpoint.json"),
        )
        assert [h["population"] for h in killed["history"]] == [h["population"] for h in whole["history"]]
        assert killed["evaluated"] == whole["evaluated"]
        assert len(killed["evaluated"]) == len(whole["evaluated"]) >= 7
        assert len((out / name / "generations.jsonl").read_text().splitlines()) == len(whole["history"])
    ga, cmaes = read_json(out / "ga" / "checkpoint.json"), read_json(out / "cmaes" / "checkpoint.json")
    assert len(cmaes["evaluated"]) == len(ga["evaluated"])  # the same budget
    assert ga["history"][0]["population"][0] == [[0, 1.5], [1, 1.5], [2, 1.5], [3, 1.5]]  # Eq. 8, 4 layers
    assert load_method(out) == load_method(reference)
    for report in ("fitness.png", "factors.png", "factors.md", "summary.md", "results.json"):
        assert (out / report).is_file()
    rows = read_json(out / "results.json")["rows"]
    assert {(r["split"], r["method"]) for r in rows} == {
        (split, method)
        for split in ("calibration", "held-out")
        for method in ("none", "pi", "mspoe", "layerwise-ga", "layerwise-cmaes")
    }

    # The pick is a LayerWise config that loads and rescales the model, and unrescales exactly.
    config = load_method(out)
    assert isinstance(config, LayerWise) and len(config.control_points) == 4
    model, _ = load_model(str(tiny_folder), threads=1)
    ids = torch.arange(3, 60)[None]
    with torch.no_grad():
        before = model(ids).logits
        rescale(model, config)
        during = model(ids).logits
        unrescale(model)
        after = model(ids).logits
    assert not torch.allclose(before, during)
    assert torch.equal(before, after)

    # Other settings on the same folder are refused, not mixed in.
    capsys.readouterr()
    changed = [*SEARCH, "--model", str(tiny_folder), "--out", str(out), "--population-size", "5"]
    assert main(changed) == 1
    assert "other settings" in capsys.readouterr().err


def test_heads_and_hidden_commands_write_configs_that_load(tiny_folder, tmp_path):
    small = ["--model", str(tiny_folder), "--threads", "1", "--documents", "3", "--examples", "2"]
    heads = tmp_path / "heads"
    assert main(["calibrate", "heads", *small, "--out", str(heads), "--heldout-examples", "1"]) == 0
    config = load_method(heads)
    assert isinstance(config, MsPoE) and config.is_static and len(config.head_order) == 4
    assert "Held-out" in (heads / "summary.md").read_text()

    hidden = tmp_path / "hidden"
    dimension_search = ["--dim-samples", "1", "--dim-length", "80", "--dim-skip", "16", "--dim-top-k", "2"]
    dimension_search += ["--dim-savgol-window", "11", "--dim-factors", "0.0,-1.0"]
    assert main(["calibrate", "hidden", *small, "--out", str(hidden), *dimension_search]) == 0
    report = read_json(hidden / "report.json")
    assert report["settings"]["factors"] == [0.0, -1.0] and report["settings"]["length"] == 80
    if report["config"] is None:
        assert not (hidden / "rag_mspoe_method.json").exists()
    else:
        assert load_method(hidden).to_dict() == report["config"]


@pytest.mark.slow
def test_ray_workers_score_as_the_local_engine(tiny_folder):
    pytest.importorskip("ray")
    import ray

    from rag_mspoe.eval.settings_search.fitness import RayEvaluator, start_ray_workers

    split = CalibrationSplit(num_documents=3, num_examples=1, seed=3)
    methods = [None, Uniform(2.0), LayerWise(control_points=[(0, 2.0), (3, 1.0)])]
    local_engine = Engine.load(str(tiny_folder), threads=1)
    local = LocalEvaluator(local_engine, split, progress=False)
    expected = dict(local.evaluate(methods))
    # The same replicas then score another split, as a search reuses them every generation.
    other = CalibrationSplit(task="kv", num_documents=3, num_examples=1, seed=4)
    expected_other = dict(LocalEvaluator(local_engine, other, progress=False).evaluate(methods[1:]))
    try:
        pool = start_ray_workers(str(tiny_folder), workers=2)
        got = dict(RayEvaluator(pool, split, local.model_name).evaluate(methods))
        got_other = dict(RayEvaluator(pool, other, local.model_name).evaluate(methods[1:]))
    finally:
        ray.shutdown()
    assert sorted(got) == [0, 1, 2] and sorted(got_other) == [0, 1]
    for scores, wanted in ((got, expected), (got_other, expected_other)):
        for index in scores:
            assert scores[index].accuracy == wanted[index].accuracy
            assert scores[index].probability == pytest.approx(wanted[index].probability, abs=1e-6)


@pytest.mark.slow
def test_a_very_small_search_on_the_embedded_model(tmp_path):
    out = tmp_path / "embedded"
    args = ["calibrate", "layers", "--out", str(out), "--threads", "1", "--documents", "3", "--examples", "1"]
    args += ["--heldout-examples", "0", "--population-size", "2", "--generations", "2", "--top-k", "1"]
    args += ["--mutation-size", "1", "--crossover-size", "0", "--metric", "choice-prob", "--optimizers", "ga"]
    assert main(args) == 0
    results = read_json(out / "results.json")
    assert results["num_layers"] == 30
    assert [o["evaluations"] for o in results["optimizers"]] == [3]
    for optimizer in results["optimizers"]:
        assert len(optimizer["factors"]) == 30 and all(1.0 <= f <= 2.0 for f in optimizer["factors"])
    rows = {r["method"]: r for r in results["rows"]}
    assert set(rows) == {"none", "pi", "mspoe", "layerwise-ga"}
    assert all(0 <= r["fitness"] <= 1 for r in rows.values())
    assert rows["pi"]["scores"] != rows["none"]["scores"]
    ga = read_json(out / "ga" / "checkpoint.json")
    assert ga["history"][0]["population"][0] == [[0, 1.5], [10, 1.5], [19, 1.5], [29, 1.5]]  # Eq. 8
    assert (out / "fitness.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    layer_rows = [
        line for line in (out / "factors.md").read_text().splitlines() if re.match(r"\| \d+ \| ", line)
    ]
    assert len(layer_rows) == 30  # one row per layer
