"""The `serve` command's start-up checks: they fail in one clear line, before any model loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rag_mspoe.cli import main
from rag_mspoe.connectors.serve_command import allowed_hosts, check_exposure


def run_cli(capsys, *args: str) -> tuple[int, str]:
    try:
        code = main(list(args))
    except SystemExit as exit:  # argparse refuses an option value
        code = int(exit.code or 0)
    return code, capsys.readouterr().err


def test_a_missing_method_config_is_a_one_line_error(tmp_path, capsys):
    code, err = run_cli(capsys, "serve", "--method-config", f"mine={tmp_path / 'missing.json'}")
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert "--method-config" in last and "missing.json" in last and "No method config" in last


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"method": "uniform", "factor": "big"}', ["factor", "'big'"]),
        ('{"method": "uniform", "factor": 1e309}', ["factor", "finite", "inf"]),
        ('{"method": "uniform", "factor": NaN}', ["factor", "finite", "nan"]),
        ('{"method": "mspoe", "min_ratio": 0}', ["min_ratio", "positive", "0"]),
        ('{"method": "mspoe", "max_ratio": Infinity}', ["max_ratio", "inf"]),
    ],
)
def test_a_bad_method_config_value_names_the_field_and_the_value(tmp_path, capsys, text, words):
    path = tmp_path / "mine.json"
    path.write_text(text)
    code, err = run_cli(capsys, "serve", "--method-config", f"mine={path}")
    assert code == 2 and "Traceback" not in err and "invalid _method_option value" not in err
    last = err.strip().splitlines()[-1]
    assert "mine.json" in last and all(word in last for word in words), last


def test_a_non_loopback_address_without_an_api_key_is_refused_naming_the_fix():
    env = {k: v for k, v in os.environ.items() if k != "RAG_MSPOE_API_KEY"}
    command = [sys.executable, "-m", "rag_mspoe.cli", "serve", "--host", "0.0.0.0", "--port", "9"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)  # not served
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "--api-key" in done.stderr and "--allow-unauthenticated" in done.stderr


def test_exposure_is_allowed_on_loopback_with_a_key_or_when_asked():
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        check_exposure(host, None, allow_unauthenticated=False)
    check_exposure("0.0.0.0", "key", allow_unauthenticated=False)
    check_exposure("0.0.0.0", None, allow_unauthenticated=True)
    for host in ("0.0.0.0", "192.168.1.5", "::", "myhost.lan"):
        with pytest.raises(ValueError, match="--allow-unauthenticated"):
            check_exposure(host, None, allow_unauthenticated=False)


def test_the_bound_address_and_the_names_given_are_answered_besides_loopback():
    assert allowed_hosts("127.0.0.1", []) == ["localhost", "127.0.0.1", "::1", "127.0.0.1"]
    assert allowed_hosts("0.0.0.0", ["api.example"]) == ["localhost", "127.0.0.1", "::1", "api.example"]
    assert "10.0.0.5" in allowed_hosts("10.0.0.5", [])


def test_a_method_spec_with_an_empty_part_is_refused_even_beside_a_saved_config(
    tmp_path, capsys, monkeypatch
):
    from rag_mspoe import Uniform

    Uniform(factor=2.0).save(tmp_path)  # what an empty part used to read from the working folder
    monkeypatch.chdir(tmp_path)

    def no_model(*args, **kwargs):
        raise AssertionError("the spec was accepted: the model is loading")

    monkeypatch.setattr("rag_mspoe.engine.Engine.load", no_model)
    for spec in ("mspoe+", "+pi", "none+"):
        code, err = run_cli(capsys, "serve", "--method", spec)
        assert code == 1 and "Traceback" not in err
        assert f"Method spec {spec!r} has an empty part" in err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "option, value, words",
    [
        ("--header-timeout", "0", ["--header-timeout", "positive"]),
        ("--max-connections", "0", ["--max-connections"]),
        ("--max-connections-per-client", "0", ["--max-connections-per-client"]),
    ],
)
def test_bad_connection_limits_are_refused_before_the_model_loads(capsys, monkeypatch, option, value, words):
    from rag_mspoe.engine import Engine

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(Engine, "load", no_loading)
    code, err = run_cli(capsys, "serve", option, value)
    last = err.strip().splitlines()[-1]
    assert code == 1 and "Traceback" not in err and all(word in last for word in words), err
