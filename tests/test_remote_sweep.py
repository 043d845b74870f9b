"""Sweeps against an OpenAI-compatible endpoint: the records of a local sweep, from our own server;
the refusals a server without prompt log-probabilities or a hooked method get; retries and the
request budget."""

from __future__ import annotations

import pytest
import torch
from fake_endpoint import FakeBehaviour, fake_endpoint

from rag_mspoe.engine.remote_client import Endpoint
from rag_mspoe.eval.runs.results import RESULTS_FILE, read_records
from rag_mspoe.eval.sweep.plan import SweepConfig
from rag_mspoe.eval.sweep.remote import RemoteTarget
from rag_mspoe.eval.sweep.run import run_sweep

MODEL = "smollm2-135m-instruct"
SMALL = {"num_documents": 3, "positions": (0, 2), "samples": 2, "batch_size": 4}


def keyed(folder):
    return {(r["method"], r["position"], r["example_id"]): r for r in read_records(folder / RESULTS_FILE)}


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded model's tokenizer alone: the fake endpoint's, and the one sweeps render with."""
    from rag_mspoe.eval.sweep.remote import load_tokenizer

    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def fp32_server():
    """`rag-mspoe serve`'s app over the embedded model in fp32, unmodified by default, on a port."""
    from server_helpers import running

    from rag_mspoe import load_model
    from rag_mspoe.connectors.server import create_app
    from rag_mspoe.engine import Engine

    model, tokenizer = load_model(dtype=torch.float32)
    with running(create_app(Engine(model, tokenizer, method="none"))) as url:
        yield model, tokenizer, url


@pytest.mark.slow
def test_a_sweep_against_our_server_gives_the_local_sweeps_records(fp32_server, tmp_path):
    model, tokenizer, url = fp32_server
    settings = {
        **SMALL,
        "methods": ("none", "longcontextreorder", "invariant-reorder"),
        "metrics": ("choice", "generate"),
        "max_new_tokens": 12,
    }
    run_sweep(SweepConfig(**settings), tmp_path / "local", model=model, tokenizer=tokenizer, progress=False)
    target = RemoteTarget(Endpoint(url, MODEL, concurrency=3), tokenizer=MODEL)
    remote = run_sweep(
        SweepConfig(model=MODEL, **settings), tmp_path / "remote", remote=target, progress=False
    )

    assert remote.complete
    local, served = keyed(tmp_path / "local"), keyed(tmp_path / "remote")
    assert served.keys() == local.keys() and len(local) == 3 * 2 * 2
    for key, expected in local.items():
        got = served[key]
        assert got["gold_logprob"] == pytest.approx(expected["gold_logprob"], abs=1e-3), key
        assert got["choice_share"] == pytest.approx(expected["choice_share"], abs=1e-3), key
        for name in ("gold_tokens", "choice", "prediction", "match", "prompt_position", "prompt_tokens"):
            assert got[name] == expected[name], (key, name)
    # Invariant reordering ranked the documents as the local engine did: the gold moved alike.
    moved = [k for k in local if k[0] == "invariant-reorder" and local[k]["prompt_position"] != k[1]]
    assert moved
    from rag_mspoe.eval.runs.manifest import read_manifest

    manifest = read_manifest(tmp_path / "remote")
    assert manifest["model"]["chat_template"] == f"local tokenizer {MODEL}"
    assert manifest["sweep"]["endpoint"] == f"{url}/v1" and manifest["model"]["prompt_logprobs"] is True


def test_an_endpoint_without_prompt_logprobs_runs_generation_only(tokenizer, tmp_path, capsys):
    behaviour = FakeBehaviour(prompt_logprobs=False)
    with fake_endpoint(behaviour, tokenizer) as url:
        target = RemoteTarget(Endpoint(url, "gguf"), tokenizer=MODEL)
        with pytest.raises(ValueError, match="--metrics choice need prompt log-probabilities"):
            run_sweep(SweepConfig(model="gguf", **SMALL), tmp_path / "choice", remote=target)
        assert "Only --metrics generate" in capsys.readouterr().err
        assert len(behaviour.requests) == 1  # the probe, and nothing after the refusal

        reorder = SweepConfig(model="gguf", methods=("invariant-reorder",), metrics=("generate",), **SMALL)
        with pytest.raises(ValueError, match=r"none, longcontextreorder, random\.$"):
            run_sweep(reorder, tmp_path / "reorder", remote=target)

        config = SweepConfig(model="gguf", methods=("none", "random"), metrics=("generate",), **SMALL)
        outcome = run_sweep(config, tmp_path / "generate", remote=target, progress=False)
    assert outcome.complete
    records = read_records(tmp_path / "generate" / RESULTS_FILE)
    assert {r["prediction"] for r in records} == {"Paris"} and all("gold_logprob" not in r for r in records)


def test_a_method_that_hooks_the_model_is_refused_naming_those_that_run(tokenizer, tmp_path):
    with fake_endpoint(FakeBehaviour(), tokenizer) as url:
        target = RemoteTarget(Endpoint(url, "served"), tokenizer=MODEL)
        config = SweepConfig(model="served", methods=("none", "mspoe"), **SMALL)
        with pytest.raises(ValueError) as refused:
            run_sweep(config, tmp_path, remote=target)
    message = str(refused.value)
    assert message.startswith("mspoe: ") and "a remote server does not let us" in message
    assert "none, longcontextreorder, random, invariant-reorder" in message


def test_the_chat_endpoint_without_a_tokenizer_generates(tokenizer, tmp_path):
    behaviour = FakeBehaviour()
    with fake_endpoint(behaviour, tokenizer) as url:
        target = RemoteTarget(Endpoint(url, "hosted"))
        config = SweepConfig(model="hosted", metrics=("generate",), **SMALL)
        outcome = run_sweep(config, tmp_path, remote=target, progress=False)
    assert outcome.complete
    assert {path for path, _ in behaviour.requests} == {"/v1/chat/completions"}
    sent = behaviour.requests[0][1]
    assert sent["messages"][0].keys() == {"role", "content"} and sent["temperature"] == 0
    from rag_mspoe.eval.runs.manifest import read_manifest

    assert read_manifest(tmp_path)["sweep"]["template"] == "server-chat"


def test_failed_requests_are_retried_and_a_spent_budget_stops_a_run_that_resumes(tokenizer, tmp_path, capsys):
    from rag_mspoe.eval.sweep.plan import load_examples

    behaviour = FakeBehaviour(failures=2)
    config = SweepConfig(model="served", metrics=("choice",), **{**SMALL, "batch_size": 2})  # 2 batches
    per_batch = 2 * len(load_examples(config)[0].candidates)  # 2 items, each candidate one request
    with fake_endpoint(behaviour, tokenizer) as url:
        # The probe takes 3 requests (2 answered 503, retried), then one batch fits the budget.
        budget = Endpoint(url, "served", backoff_s=0.01, max_requests=3 + per_batch + 1)
        first = run_sweep(config, tmp_path, remote=RemoteTarget(budget, MODEL), progress=False)
        assert "request budget of" in capsys.readouterr().err
        assert first.total == 2 and first.expected == 4
        rest = run_sweep(
            config, tmp_path, remote=RemoteTarget(Endpoint(url, "served"), MODEL), progress=False
        )
    assert rest.complete and rest.written == 2  # nothing scored twice


def test_a_wrong_address_fails_at_the_probe_with_the_servers_answer_and_no_retries(tokenizer, tmp_path):
    from rag_mspoe.engine.remote_client import EndpointError

    behaviour = FakeBehaviour()
    with fake_endpoint(behaviour, tokenizer) as url:
        target = RemoteTarget(Endpoint(url.replace("/v1", "/api"), "served"), tokenizer=MODEL)
        with pytest.raises(EndpointError, match="answered HTTP 404: no route /api/completions"):
            run_sweep(SweepConfig(model="served", **SMALL), tmp_path, remote=target)
    assert len(behaviour.requests) == 1
