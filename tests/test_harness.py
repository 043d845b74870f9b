"""lm-evaluation-harness backend: the harness's numbers on a rescaled model are ours, and runs resume."""

from __future__ import annotations

import copy
import json
import re
import sys

import pytest
import torch
from eval_run_helpers import save_tiny_chat_model

from rag_mspoe import current_method, rescaled, unrescale
from rag_mspoe.cli import main
from rag_mspoe.engine import Engine
from rag_mspoe.eval.harness import HarnessConfig, harness_lm, run_harness, task_manager
from rag_mspoe.eval.runs.results import read_records

lm_eval = pytest.importorskip("lm_eval")

MC_TASK = "rag_mspoe_mc"
GEN_TASK = "rag_mspoe_gen"
DOCS = [
    {
        "question": "What is the capital of France?",
        "choices": ["Paris", "Berlin", "Madrid city"],
        "answer": 0,
    },
    {"question": "Which animal says moo?", "choices": ["a cow", "a small cat"], "answer": 0},
    {
        "question": "How many legs has a spider, counting all of them carefully?",
        "choices": ["eight", "six legs in total", "four"],
        "answer": 0,
    },
    {"question": "What colour is the sky?", "choices": ["blue", "green"], "answer": 0},
]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """A folder with a local multiple-choice task and a generate_until task over the same JSONL."""
    folder = tmp_path_factory.mktemp("tasks")
    data = folder / "questions.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    common = f"""dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
"""
    (folder / "mc.yaml").write_text(
        f"task: {MC_TASK}\noutput_type: multiple_choice\n{common}"
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (folder / "gen.yaml").write_text(
        f"task: {GEN_TASK}\noutput_type: generate_until\n{common}"
        'doc_to_target: "{{choices[answer]}}"\n'
        'generation_kwargs:\n  until: ["Question:"]\n  max_gen_toks: 8\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    return folder


@pytest.fixture(scope="module")
def fp32(embedded):
    """An fp32 copy of the embedded model: the harness and our scorers then agree to rounding."""
    model, tokenizer = embedded
    assert current_method(model) is None
    return copy.deepcopy(model).float(), tokenizer


def harness_logliks(lm, tasks) -> dict[tuple[str, str], float]:
    manager = task_manager([MC_TASK], str(tasks))
    output = lm_eval.simple_evaluate(model=lm, tasks=[MC_TASK], task_manager=manager, log_samples=True)
    found = {}
    for sample in output["samples"][MC_TASK]:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"], strict=True):
            found[(context, continuation)] = response[0][0]
    return found


def direct_loglik(model, tokenizer, context: str, continuation: str, method) -> float:
    """Sum of log-probabilities of the continuation's tokens after the context, in one forward."""
    context_ids = tokenizer(context)["input_ids"]
    whole = tokenizer(context + continuation)["input_ids"]
    with rescaled(model, method), torch.inference_mode():
        logits = model(torch.tensor([whole[:-1]])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(float(logprobs[i - 1, whole[i]]) for i in range(len(context_ids), len(whole)))


@pytest.mark.slow
def test_harness_loglikelihoods_are_those_of_the_rescaled_model(fp32, tasks):
    model, tokenizer = fp32
    engine = Engine(model, tokenizer)
    by_method = {}
    for spec in ("none", "pi:2", "mspoe"):
        # batch_size=4 mixes requests of different lengths; per-prompt Ms-PoE must run them alone.
        lm = harness_lm(model, tokenizer, spec, batch_size=4)
        method = current_method(model)
        try:
            logliks = harness_logliks(lm, tasks)
        finally:
            unrescale(model)
        assert len(logliks) == sum(len(doc["choices"]) for doc in DOCS)
        for (context, continuation), value in logliks.items():
            # Under the harness Ms-PoE ranks heads on the whole request, as a direct forward does.
            assert value == pytest.approx(
                direct_loglik(model, tokenizer, context, continuation, method), abs=1e-3
            )
            if spec != "mspoe":  # our scorer ranks Ms-PoE heads on the prompt only
                ((ours, _),) = engine.score_continuations(context, [continuation], raw=True, method=method)
                assert value == pytest.approx(ours, abs=1e-3)
        by_method[spec] = logliks
    for spec in ("pi:2", "mspoe"):
        changes = [abs(by_method[spec][key] - by_method["none"][key]) for key in by_method["none"]]
        assert max(changes) > 0.1, spec


@pytest.mark.slow
def test_generation_under_the_harness_is_our_greedy_generation(embedded, tasks):
    model, tokenizer = embedded
    lm = harness_lm(model, tokenizer, "mspoe", batch_size=2)
    method = current_method(model)
    try:
        manager = task_manager([GEN_TASK], str(tasks))
        output = lm_eval.simple_evaluate(
            model=lm, tasks=[GEN_TASK], task_manager=manager, limit=2, log_samples=True
        )
    finally:
        unrescale(model)
    samples = output["samples"][GEN_TASK]
    assert len(samples) == 2
    engine = Engine(model, tokenizer)
    for sample in samples:
        context = sample["arguments"][0][0]
        ours = engine.generate(context, raw=True, max_new_tokens=8, stop=["Question:"], method=method)
        assert sample["resps"][0][0] == ours.text
    assert any(sample["resps"][0][0].strip() for sample in samples)


@pytest.mark.slow
def test_run_folder_holds_every_record_resumes_and_leaves_the_model_unmodified(
    embedded, tasks, tmp_path, monkeypatch
):
    model, tokenizer = embedded
    probe = torch.tensor([tokenizer("The harbour of Vossel was dredged in 1787.")["input_ids"]])
    with torch.inference_mode():
        before = model(probe).logits
    config = HarnessConfig(
        tasks=(MC_TASK,), methods=("none", "pi:2"), include_path=str(tasks), limit=3, batch_size=4
    )
    summary = run_harness(config, tmp_path, model=model, tokenizer=tokenizer, progress=False)

    records = read_records(tmp_path / "results.jsonl")
    assert sorted((r["method"], r["task"], r["metric"]) for r in records) == [
        (method, MC_TASK, metric) for method in ("none", "pi:2") for metric in ("acc", "acc_norm")
    ]
    for record in records:
        assert 0 <= record["value"] <= 1 and record["stderr"] is not None and record["samples"] == 3
    assert summary["results"]["pi:2"][f"{MC_TASK}/acc"]["value"] == next(
        r["value"] for r in records if r["method"] == "pi:2" and r["metric"] == "acc"
    )
    table = (tmp_path / "table.md").read_text()
    assert f"{MC_TASK}/acc_norm" in table and "| none |" in table and "| pi:2 |" in table
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["harness"]["tasks"] == [MC_TASK] and set(manifest["methods"]) == {"none", "pi:2"}
    assert "lm-eval" in manifest["sessions"][0]["versions"]

    # Resumed with nothing left to do: the harness is not called and nothing is written.
    written = (tmp_path / "results.jsonl").read_bytes()

    def no_evaluation(**kwargs):
        raise AssertionError("a complete run evaluated again")

    monkeypatch.setattr(lm_eval, "simple_evaluate", no_evaluation)
    run_harness(config, tmp_path, model=model, tokenizer=tokenizer, progress=False)
    assert (tmp_path / "results.jsonl").read_bytes() == written
    monkeypatch.undo()

    # A method added later runs alone; the others keep their records.
    more = HarnessConfig(
        tasks=(MC_TASK,), methods=("none", "pi:2", "layerwise"), include_path=str(tasks), limit=3
    )
    run_harness(more, tmp_path, model=model, tokenizer=tokenizer, progress=False)
    resumed = (tmp_path / "results.jsonl").read_bytes()
    assert resumed.startswith(written)
    assert {r["method"] for r in read_records(tmp_path / "results.jsonl")[len(records) :]} == {"layerwise"}

    assert current_method(model) is None
    with torch.inference_mode():
        assert torch.equal(model(probe).logits, before)

    with pytest.raises(ValueError, match="limit: 3 there, 2 now"):
        run_harness(HarnessConfig(tasks=(MC_TASK,), include_path=str(tasks), limit=2), tmp_path, model=model)


def test_harness_command_on_a_local_task(tasks, tmp_path, capsys):
    model_dir = save_tiny_chat_model(tmp_path / "tiny")
    out = tmp_path / "run"
    command = ["harness", "--tasks", MC_TASK, "--include-path", str(tasks), "--out", str(out)]
    options = ["--methods", "none", "mspoe", "--limit", "2", "--model", str(model_dir), "--no-progress"]
    assert main([*command, *options]) == 0
    assert "| mspoe |" in capsys.readouterr().out
    assert len(read_records(out / "results.jsonl")) == 4


@pytest.mark.slow  # indexes the harness's few thousand task files
def test_an_unknown_task_fails_with_the_fix(tasks):
    with pytest.raises(ValueError, match=r"Unknown task\(s\) \['no_such_task_xyz'\].*lm-eval ls tasks"):
        task_manager([MC_TASK, "no_such_task_xyz"], str(tasks))


def test_without_the_harness_installed_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(ImportError, match=re.escape('pip install "rag-mspoe[harness]"')):
        harness_lm(None, None, "mspoe")


@pytest.mark.slow
def test_the_harness_over_the_server_scores_as_the_rescaled_model(fp32, tasks):
    """lm-evaluation-harness's own `local-completions` model against the OpenAI-compatible server
    (echo with logprobs, three prompts per request): each loglikelihood is the rescaled model's,
    the method picked by name."""
    pytest.importorskip("fastapi")
    from server_helpers import running

    from rag_mspoe.connectors.server import create_app

    model, tokenizer = fp32
    engine = Engine(model, tokenizer, method="none")
    arguments = (
        f"model={engine.name}+pi,tokenizer_backend=huggingface,tokenizer={tokenizer.name_or_path},"
        "tokenized_requests=False,num_concurrent=1,max_retries=1,batch_size=3"
    )
    with running(create_app(engine)) as url:
        output = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"{arguments},base_url={url}/v1/completions",
            tasks=[MC_TASK],
            task_manager=task_manager([MC_TASK], str(tasks)),
            log_samples=True,
        )
    samples = output["samples"][MC_TASK]
    assert sum(len(sample["arguments"]) for sample in samples) == sum(len(doc["choices"]) for doc in DOCS)
    pi = engine.method_config("pi")
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"], strict=True):
            expected = direct_loglik(model, tokenizer, context, continuation, pi)
            assert response[0][0] == pytest.approx(expected, abs=1e-3)
            assert abs(expected - direct_loglik(model, tokenizer, context, continuation, None)) > 1e-3
