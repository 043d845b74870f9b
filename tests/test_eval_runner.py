"""The sweep runner: complete, once-only records; resuming after a kill; the manifest; settings checks."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
from eval_run_helpers import save_tiny_chat_model, tiny_chat_model

from rag_mspoe.eval.data.loaders import save_jsonl
from rag_mspoe.eval.data.records import gold_index, with_gold_at
from rag_mspoe.eval.data.synthetic import generate_invented_qa
from rag_mspoe.eval.runs.results import read_records
from rag_mspoe.eval.sweep.batch_scorer import candidates_of
from rag_mspoe.eval.sweep.plan import SweepConfig
from rag_mspoe.eval.sweep.run import frozen_examples, run_sweep
from rag_mspoe.methods.method_spec import resolve
from rag_mspoe.models.devices import default_dtype


@pytest.fixture(scope="module")
def tiny():
    return tiny_chat_model()


def keys(records):
    return [(r["method"], r["position"], r["example_id"]) for r in records]


def test_sweep_scores_every_method_position_and_example_once(tiny, tmp_path):
    config = SweepConfig(
        num_documents=6,
        positions=(0, 3, 5),
        methods=("none", "mspoe", "longcontextreorder", "dynamic-ntk"),
        samples=4,
        batch_size=3,
        metrics=("choice", "generate"),
        max_new_tokens=4,
    )
    outcome = run_sweep(config, tmp_path, model=tiny[0], tokenizer=tiny[1], progress=False)
    records = read_records(tmp_path / "results.jsonl")
    assert outcome.complete and outcome.written == len(records) == 4 * 3 * 4
    assert len(set(keys(records))) == len(records)
    for record in records:
        assert record["choice_correct"] in (0.0, 1.0) and record["match"] in (0.0, 1.0)
        assert 0 < record["choice_share"] < 1
        assert record["gold_logprob"] < 0 and record["gold_tokens"] >= 1
        _, slots = resolve(record["method"]).arrange(list(range(6)), seed=0)
        assert record["prompt_position"] == slots.index(record["position"])
    for name in ("summary.json", "table.md", "accuracy_by_position.png", "examples.jsonl.gz"):
        assert (tmp_path / name).is_file()


@pytest.mark.parametrize(("task", "generator"), [("qa", "invented-qa"), ("kv", "kv-short")])
def test_a_sweep_runs_the_methods_that_read_documents(tiny, tmp_path, monkeypatch, task, generator):
    from rag_mspoe.engine import Engine
    from rag_mspoe.eval.sweep.batch_scorer import prompt_of

    monkeypatch.setenv("RAG_MSPOE_CACHE", str(tmp_path / "cache"))  # the calibration's bias estimate
    config = SweepConfig(
        task=task,
        generator=generator,
        num_documents=4,
        positions=(0, 3),
        methods=("none", "pine", "attention-calibration", "calibrated-reorder"),
        samples=2,
        metrics=("choice", "generate"),
        max_new_tokens=3,
    )
    outcome = run_sweep(config, tmp_path / "run", model=tiny[0], tokenizer=tiny[1], progress=False)
    records = read_records(tmp_path / "run" / "results.jsonl")
    assert outcome.complete and len(records) == 2 * 2 * 4
    # The sweep scores each prompt as the engine does with the prompt's documents.
    engine = Engine(*tiny, method="none")
    examples = {e.id: e for e in frozen_examples(config, tmp_path / "run")}
    for record in records:
        placed = with_gold_at(examples[record["example_id"]], record["position"])
        answer = candidates_of(placed)[1]
        prompt = prompt_of(placed, resolve(record["method"]))  # PINE reads its documents by content
        (expected, _), *_ = engine.score_continuations(prompt, [answer], method=record["method"])
        assert record["gold_logprob"] == pytest.approx(expected, abs=1e-4)
    by_method = {m: [r["gold_logprob"] for r in records if r["method"] == m] for m in config.methods}
    assert by_method["pine"] != by_method["none"] != by_method["attention-calibration"]


def test_a_reordered_prompt_the_unmodified_model_already_read_takes_its_scores(tiny, tmp_path, monkeypatch):
    # With two documents every reordering is the unmodified model's prompt at gold position 0 or 1.
    from rag_mspoe.engine import Engine
    from rag_mspoe.eval.sweep.batch_scorer import prompt_of

    monkeypatch.setenv("RAG_MSPOE_CACHE", str(tmp_path / "cache"))
    settings = dict(
        num_documents=2, positions=(0, 1), samples=3, metrics=("choice", "generate"), max_new_tokens=4
    )
    shared = SweepConfig(methods=("none", "calibrated-reorder"), **settings)
    alone = SweepConfig(methods=("calibrated-reorder",), **settings)
    run_sweep(shared, tmp_path / "shared", model=tiny[0], tokenizer=tiny[1], progress=False)
    run_sweep(alone, tmp_path / "alone", model=tiny[0], tokenizer=tiny[1], progress=False)
    records = read_records(tmp_path / "shared" / "results.jsonl")
    by_key = {(r["method"], r["position"], r["example_id"]): r for r in records}
    alone_records = read_records(tmp_path / "alone" / "results.jsonl")
    computed = {(r["position"], r["example_id"]): r for r in alone_records}
    engine = Engine(*tiny, method="none")
    examples = {e.id: e for e in frozen_examples(shared, tmp_path / "shared")}
    reordered = [r for r in records if r["method"] == "calibrated-reorder"]
    assert len(reordered) == 6
    for record in reordered:
        label, position = record["same_prompt_as"]
        assert label == "none" and record["prompt_position"] == position
        source = by_key["none", position, record["example_id"]]
        assert record["prediction"] == source["prediction"] and record["choice"] == source["choice"]
        # The scores are the ones the method gives when it runs: in the run without the
        # unmodified model, and through the engine.
        fresh = computed[record["position"], record["example_id"]]
        # (There the label reads a prompt it wrote at both gold positions once.)
        assert fresh.get("same_prompt_as", ["calibrated-reorder"])[0] == "calibrated-reorder"
        assert fresh["prompt_position"] == position
        assert fresh["prediction"] == record["prediction"]
        assert fresh["gold_logprob"] == pytest.approx(record["gold_logprob"], abs=1e-4)
        placed = with_gold_at(examples[record["example_id"]], record["position"])
        answer = candidates_of(placed)[1]
        prompt = prompt_of(placed)
        ((expected, _),) = engine.score_continuations(prompt, [answer], method="calibrated-reorder")
        assert record["gold_logprob"] == pytest.approx(expected, abs=1e-4)


def test_calibrated_reorderings_of_one_run_share_their_ranking_pass(tiny, tmp_path, monkeypatch):
    # The second label ranks from the attention the first recorded, and answers as it does alone.
    from rag_mspoe.engine import Engine
    from rag_mspoe.eval.sweep.batch_scorer import prompt_of
    from rag_mspoe.methods import CalibratedReorder

    monkeypatch.setenv("RAG_MSPOE_CACHE", str(tmp_path / "cache"))
    variant = CalibratedReorder(place="sorted", layers=[0], strength=0.5)
    saved = variant.save(tmp_path / "sorted.json")
    default = CalibratedReorder().save(tmp_path / "default.json")
    settings = dict(num_documents=4, positions=(0, 3), samples=2, metrics=("loglik",))
    shared = SweepConfig(methods=("calibrated-reorder", f"sorted={saved}", f"same={default}"), **settings)
    alone = SweepConfig(methods=(f"sorted={saved}",), **settings)
    run_sweep(shared, tmp_path / "shared", model=tiny[0], tokenizer=tiny[1], progress=False)
    run_sweep(alone, tmp_path / "alone", model=tiny[0], tokenizer=tiny[1], progress=False)
    records = read_records(tmp_path / "shared" / "results.jsonl")
    layers = tiny[0].config.num_hidden_layers
    first = {(r["position"], r["example_id"]): r for r in records if r["method"] == "calibrated-reorder"}
    second = [r for r in records if r["method"] == "sorted"]
    assert len(first) == len(second) == 4
    for record in first.values():
        attention = record["ranking_attention"]
        assert len(attention) == layers and all(len(row) == 4 for row in attention)
    computed = {
        (r["position"], r["example_id"]): r for r in read_records(tmp_path / "alone" / "results.jsonl")
    }
    engine = Engine(*tiny, method="none")
    examples = {e.id: e for e in frozen_examples(shared, tmp_path / "shared")}
    for record in second:
        key = (record["position"], record["example_id"])
        assert record["ranking_from"] == "calibrated-reorder" and "ranking_attention" not in record
        assert computed[key]["ranking_attention"] == first[key]["ranking_attention"]
        assert record["prompt_position"] == computed[key]["prompt_position"]
        assert record["gold_logprob"] == pytest.approx(computed[key]["gold_logprob"], abs=1e-4)
        placed = with_gold_at(examples[record["example_id"]], record["position"])
        ((expected, _),) = engine.score_continuations(
            prompt_of(placed), [candidates_of(placed)[1]], method=variant
        )
        assert record["gold_logprob"] == pytest.approx(expected, abs=1e-4)
    # The variant's own order is not the default's on every item (the test would pass trivially).
    assert any(
        r["prompt_position"] != first[r["position"], r["example_id"]]["prompt_position"] for r in second
    )
    # The default under another label writes prompts the first label scored (at this gold position,
    # or at another whose reordering wrote the same text): it takes their scores.
    for record in (r for r in records if r["method"] == "same"):
        label, position = record["same_prompt_as"]
        source = first[position, record["example_id"]]
        assert label == "calibrated-reorder" and "ranking_attention" not in record
        assert record["gold_logprob"] == source["gold_logprob"]
        assert record["prompt_position"] == source["prompt_position"]


def test_a_variant_added_to_a_run_recorded_without_rankings_ranks_once_and_takes_known_scores(
    tiny, tmp_path, monkeypatch
):
    # A run from before sweeps recorded the ranking pass: the variant runs the pass itself, then
    # finds its prompts among those the first label scored.
    from rag_mspoe.methods import CalibratedReorder

    monkeypatch.setenv("RAG_MSPOE_CACHE", str(tmp_path / "cache"))
    default = CalibratedReorder().save(tmp_path / "default.json")
    run = tmp_path / "run"  # beside the config and the cache, not around them
    settings = dict(num_documents=4, positions=(0, 3), samples=2, metrics=("loglik",))
    run_sweep(
        SweepConfig(methods=("calibrated-reorder",), **settings),
        run,
        model=tiny[0],
        tokenizer=tiny[1],
        progress=False,
    )
    results = run / "results.jsonl"
    older = [{k: v for k, v in r.items() if k != "ranking_attention"} for r in read_records(results)]
    results.write_text("".join(json.dumps(r) + "\n" for r in older))
    both = SweepConfig(methods=("calibrated-reorder", f"same={default}"), **settings)
    run_sweep(both, run, model=tiny[0], tokenizer=tiny[1], progress=False)
    first = {(r["position"], r["example_id"]): r for r in older}
    added = [r for r in read_records(results) if r["method"] == "same"]
    assert len(added) == 4
    for record in added:
        label, position = record["same_prompt_as"]
        assert label == "calibrated-reorder" and "ranking_attention" in record
        assert record["gold_logprob"] == first[position, record["example_id"]]["gold_logprob"]


def test_a_labelled_method_is_recorded_under_its_label(tiny, tmp_path):
    config = SweepConfig(num_documents=4, positions=(0, 3), methods=("none", "half=pi:2"), samples=2)
    outcome = run_sweep(config, tmp_path, model=tiny[0], tokenizer=tiny[1], progress=False)
    assert outcome.complete
    assert {r["method"] for r in read_records(tmp_path / "results.jsonl")} == {"none", "half"}


def test_manifest_records_model_methods_versions_and_commit(tiny, tmp_path):
    config = SweepConfig(num_documents=4, positions=(0, 3), methods=("none", "layerwise+pi"), samples=2)
    run_sweep(config, tmp_path, model=tiny[0], tokenizer=tiny[1], progress=False, report=False)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["model"]["name"] == "tiny-llama" and manifest["model"]["num_layers"] == 4
    assert manifest["methods"]["layerwise+pi"]["method"]["method"] == "compose"
    assert manifest["sweep"]["positions"] == [0, 3]
    session = manifest["sessions"][-1]
    assert {"torch", "transformers", "rag-mspoe"} <= set(session["versions"])
    assert len(session["git"]["commit"]) == 40 and session["complete"] is True


def test_manifest_records_dtype_quantization_and_threads_of_a_loaded_model(tmp_path):
    model_dir = save_tiny_chat_model(tmp_path / "model")
    config = SweepConfig(
        num_documents=3, positions=(0, 2), methods=("none",), samples=1, model=str(model_dir)
    )
    run_sweep(config, tmp_path / "run", threads=1, quantize="int8", progress=False, report=False)
    model = json.loads((tmp_path / "run" / "manifest.json").read_text())["model"]
    dtype = str(default_dtype("cpu")).removeprefix("torch.")  # the embeddings and norms
    assert (model["dtype"], model["quantization"], model["threads"]) == (dtype, "int8", 1)


def test_resume_adds_only_what_is_missing_and_refuses_another_sweep(tiny, tmp_path):
    base = dict(num_documents=4, positions=(0, 3), samples=3, batch_size=2)
    run_sweep(
        SweepConfig(methods=("none",), **base), tmp_path, model=tiny[0], tokenizer=tiny[1], progress=False
    )
    first = read_records(tmp_path / "results.jsonl")
    again = run_sweep(
        SweepConfig(methods=("none", "pi"), **base),
        tmp_path,
        model=tiny[0],
        tokenizer=tiny[1],
        progress=False,
    )
    records = read_records(tmp_path / "results.jsonl")
    assert again.written == 6 and records[: len(first)] == first
    assert Counter(r["method"] for r in records) == {"none": 6, "pi": 6}
    with pytest.raises(ValueError, match="samples: 3 there, 5 now"):
        run_sweep(
            SweepConfig(methods=("none",), **{**base, "samples": 5}),
            tmp_path,
            model=tiny[0],
            tokenizer=tiny[1],
        )


def test_a_budget_stops_between_batches_and_a_rerun_goes_on(tiny, tmp_path):
    config = SweepConfig(num_documents=4, positions=(0, 3), methods=("none", "pi"), samples=4, batch_size=2)
    options = dict(model=tiny[0], tokenizer=tiny[1], progress=False)
    first = run_sweep(config, tmp_path, budget_hours=1e-9, **options)  # spent after the first batch
    assert first.written == 2 and not first.complete
    records = read_records(tmp_path / "results.jsonl")
    # Examples come outermost: the first batches compare the methods on the same examples.
    assert {(r["method"], r["example_id"]) for r in records} == {("none", records[0]["example_id"])}
    rest = run_sweep(config, tmp_path, **options)
    assert rest.complete and first.written + rest.written == 16
    with pytest.raises(ValueError, match="budget-hours must be a positive"):
        run_sweep(config, tmp_path, budget_hours=0, **options)


def test_examples_are_frozen_in_the_run_folder_and_a_changed_data_file_is_refused(tiny, tmp_path):
    data = tmp_path / "data.jsonl"
    save_jsonl(data, generate_invented_qa(5, 3, seed=1))
    original = data.read_bytes()
    config = SweepConfig(data=str(data), num_documents=5, positions=(0, 4), samples=3)
    run_sweep(config, tmp_path / "run", model=tiny[0], tokenizer=tiny[1], progress=False, report=False)
    save_jsonl(data, generate_invented_qa(5, 3, seed=2))  # the data file changes under a stopped run
    more = SweepConfig(data=str(data), num_documents=5, positions=(0, 2, 4), samples=3)
    with pytest.raises(ValueError, match="changed since the run in"):
        run_sweep(more, tmp_path / "run", model=tiny[0], tokenizer=tiny[1], progress=False, report=False)
    data.write_bytes(original)
    run_sweep(more, tmp_path / "run", model=tiny[0], tokenizer=tiny[1], progress=False, report=False)
    records = read_records(tmp_path / "run" / "results.jsonl")
    assert {r["example_id"] for r in records} == {"invented-1-0", "invented-1-1", "invented-1-2"}


def test_a_sweep_of_a_data_file_grows_by_more_questions_and_keeps_its_records(tiny, tmp_path):
    data = tmp_path / "data.jsonl"
    examples = generate_invented_qa(4, 5, seed=1)
    save_jsonl(data, examples)
    options = dict(model=tiny[0], tokenizer=tiny[1], progress=False, report=False)
    base = dict(data=str(data), num_documents=4, positions=(0, 3), metrics=("loglik",))
    run_sweep(SweepConfig(samples=2, **base), tmp_path / "run", **options)
    first = read_records(tmp_path / "run" / "results.jsonl")
    grown = run_sweep(SweepConfig(samples=4, **base), tmp_path / "run", **options)
    records = read_records(tmp_path / "run" / "results.jsonl")
    assert grown.written == 4 and grown.complete and records[: len(first)] == first
    assert {r["example_id"] for r in records} == {example.id for example in examples[:4]}
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["sweep"]["samples"] == 4
    with pytest.raises(ValueError, match="samples: 4 there, 3 now"):
        run_sweep(SweepConfig(samples=3, **base), tmp_path / "run", **options)
    assert read_records(tmp_path / "run" / "results.jsonl") == records


def test_a_data_file_with_more_documents_is_cut_to_the_requested_count(tiny, tmp_path):
    data = tmp_path / "data.jsonl"
    examples = generate_invented_qa(8, 2, seed=3)
    save_jsonl(data, examples)
    config = SweepConfig(data=str(data), num_documents=4, positions=(3,), samples=2, metrics=("loglik",))
    run_sweep(config, tmp_path / "run", model=tiny[0], tokenizer=tiny[1], progress=False, report=False)
    from rag_mspoe.eval.data.loaders import load_qa

    kept = load_qa(tmp_path / "run" / "examples.jsonl.gz")
    assert all(len(ex.documents) == 4 and gold_index(ex) is not None for ex in kept)
    assert all(
        "gold_logprob" in r and "choice" not in r for r in read_records(tmp_path / "run" / "results.jsonl")
    )


def test_a_killed_run_resumes_without_losing_or_duplicating_a_record(tmp_path):
    model_dir = save_tiny_chat_model(tmp_path / "model")
    options = "--documents 8 --positions 0,7 --methods none pi --samples 30 --batch-size 2 --threads 1"
    command = [sys.executable, "-m", "rag_mspoe.cli", "sweep", "--out", str(tmp_path / "run")]
    command += ["--model", str(model_dir), *options.split(), "--no-progress"]
    results = tmp_path / "run" / "results.jsonl"
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if results.is_file() and results.read_bytes().count(b"\n") >= 8:
            break
        time.sleep(0.02)
    assert process.poll() is None, process.stderr.read().decode()[-2000:] if process.stderr else ""
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    before = read_records(results)
    assert 8 <= len(before) < 120

    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-2000:]
    after = read_records(results)
    assert len(after) == 2 * 2 * 30 == len(set(keys(after)))
    assert after[: len(before)] == before
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert len(manifest["sessions"]) == 2 and manifest["sessions"][-1]["complete"] is True
    assert "120/120 records" in finished.stdout


def test_an_empty_gold_answer_is_refused_not_scored_as_zero_tokens(tiny, tmp_path):
    data = tmp_path / "data.jsonl"
    examples = generate_invented_qa(4, 2, seed=3)
    save_jsonl(data, [dataclasses.replace(examples[0], answers=("",), candidates=()), *examples[1:]])
    config = SweepConfig(data=str(data), num_documents=4, positions=(0,), samples=2, metrics=("loglik",))
    with pytest.raises(ValueError, match="answer to score is empty"):
        run_sweep(config, tmp_path / "run", model=tiny[0], tokenizer=tiny[1], progress=False, report=False)


def test_a_run_recorded_before_a_method_gained_a_setting_resumes(tiny, tmp_path, monkeypatch):
    # The manifest of a run started before calibrated reordering had min_margin: same config.
    monkeypatch.setenv("RAG_MSPOE_CACHE", str(tmp_path / "cache"))
    config = SweepConfig(num_documents=3, positions=(0, 2), methods=("calibrated-reorder",), samples=1)
    run_sweep(config, tmp_path / "run", model=tiny[0], tokenizer=tiny[1], progress=False, report=False)
    manifest_path = tmp_path / "run" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["methods"]["calibrated-reorder"]["method"]["min_margin"]
    manifest_path.write_text(json.dumps(manifest))
    grown = dataclasses.replace(config, positions=(0, 1, 2))
    load = dict(model=tiny[0], tokenizer=tiny[1], progress=False, report=False)
    outcome = run_sweep(grown, tmp_path / "run", **load)
    assert outcome.complete and outcome.written == 1
    manifest["methods"]["calibrated-reorder"]["method"]["strength"] = 2.0
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="meant another config"):
        run_sweep(grown, tmp_path / "run", **load)
