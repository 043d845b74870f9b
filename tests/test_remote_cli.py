"""The command-line faces of running past one machine: `serve --replicas/--ray/--autoscaling` refuse
bad combinations before any model loads or Ray starts; `sweep --endpoint` runs against a server."""

from __future__ import annotations

import json

import pytest
from fake_endpoint import FakeBehaviour, fake_endpoint
from test_server_cli import run_cli

from rag_mspoe.eval.runs.results import RESULTS_FILE, read_records


@pytest.mark.parametrize(
    "options, words",
    [
        (["--replicas", "2", "--autoscaling", '{"max_replicas": 3}'], ["--replicas N or --autoscaling"]),
        (["--replicas", "0"], ["--replicas must be at least 1"]),
        (["--replicas", "2", "--max-connections", "10"], ["--max-connections", "Ray Serve"]),
        (["--autoscaling", "[1, 2]"], ["expected a JSON object"]),
        (["--autoscaling", "{min"], ["not JSON"]),
    ],
)
def test_bad_ray_serve_options_are_refused_before_the_model_loads(capsys, monkeypatch, options, words):
    from rag_mspoe.engine import Engine

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(Engine, "load", no_loading)
    code, err = run_cli(capsys, "serve", *options)
    last = err.strip().splitlines()[-1]
    assert code in (1, 2) and "Traceback" not in err and all(word in last for word in words), err


def test_sweep_with_an_endpoint_scores_there_and_says_so_in_the_manifest(capsys, tmp_path, monkeypatch):
    from rag_mspoe.eval.sweep.remote import load_tokenizer

    behaviour = FakeBehaviour()
    monkeypatch.setenv("SERVED_KEY", "secret")
    with fake_endpoint(behaviour, load_tokenizer("smollm2-135m-instruct")) as url:
        arguments = ["sweep", "--endpoint", url, "--model", "served", "--out", str(tmp_path)]
        options = [
            "--documents",
            "3",
            "--samples",
            "1",
            "--no-progress",
            "--methods",
            "none",
            "longcontextreorder",
        ]
        code, err = run_cli(
            capsys,
            *arguments,
            *options,
            "--tokenizer",
            "smollm2-135m-instruct",
            "--api-key-env",
            "SERVED_KEY",
        )
    assert code == 0, err
    assert behaviour.keys == {"Bearer secret"}
    assert len(read_records(tmp_path / RESULTS_FILE)) == 2 * 3  # two methods, three positions
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert (
        manifest["sweep"]["endpoint"] == url
        and manifest["sweep"]["template"] == "tokenizer:smollm2-135m-instruct"
    )
    assert manifest["model"]["name"] == "served"


@pytest.mark.parametrize(
    "options, words",
    [
        ([], ["--endpoint needs --model NAME"]),
        (["--model", "m", "--api-key-env", "NO_SUCH_VARIABLE_HERE"], ["NO_SUCH_VARIABLE_HERE", "not set"]),
        (["--model", "m", "--ray"], ["drop --ray"]),
        (["--model", "m", "--concurrency", "0"], ["concurrency must be >= 1"]),
    ],
)
def test_bad_endpoint_options_are_refused_in_one_line(capsys, tmp_path, options, words):
    code, err = run_cli(
        capsys, "sweep", "--endpoint", "http://127.0.0.1:9/v1", "--out", str(tmp_path), *options
    )
    last = err.strip().splitlines()[-1]
    assert code == 1 and "Traceback" not in err and all(word in last for word in words), err
