"""method="calibrated": the config shipped for the loaded model, like an adapter; a clear error where
none ships. Configs are written to a temporary folder put on the search path."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import prompt_ids, tiny_model, tiny_tokenizer

from rag_mspoe import LayerWise, Uniform, current_method, parse_method, rescale, rescaled, unrescale
from rag_mspoe import calibrated as calibrated_configs
from rag_mspoe.calibrated import NoCalibratedMethodError
from rag_mspoe.cli import main
from rag_mspoe.engine import Engine
from rag_mspoe.methods.method_spec import resolve_all

CONFIG = LayerWise(factors=[1.0, 1.3, 1.6, 1.2])


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """An empty folder searched instead of the package's; write <model>.json into it."""
    monkeypatch.setattr(calibrated_configs, "SEARCH_PATH", [tmp_path])
    return tmp_path


def named_tiny(name):
    model = tiny_model("qwen2")
    model._rag_mspoe_name = name  # as load_model names it
    return model


def test_calibrated_resolves_to_the_config_for_the_model(shipped):
    CONFIG.save(shipped / "tiny-cal.json", base_model="tiny-cal")
    model = named_tiny("tiny-cal")
    ids = prompt_ids(24)
    with torch.no_grad():
        expected = rescale(model, CONFIG)(ids).logits
        unrescale(model)
        assert current_method(rescale(model, "calibrated")) == CONFIG
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
        unrescale(model)
        with rescaled(model, "calibrated"):
            assert current_method(model) == CONFIG
    assert parse_method("calibrated", "tiny-cal") == CONFIG


def test_engine_takes_calibrated_as_default_and_per_call(shipped):
    Uniform(factor=1.25).save(shipped / "tiny-cal.json", base_model="tiny-cal")
    tokenizer = tiny_tokenizer()
    engine = Engine(named_tiny("tiny-cal"), tokenizer, method="calibrated", name="shown under another name")
    assert engine.method == Uniform(factor=1.25)  # found by the model's name, not the display name
    plain = Engine(named_tiny("tiny-cal"), tokenizer, method="none")
    per_call = plain.generate("abcabc", raw=True, max_new_tokens=3, method="calibrated")
    assert per_call.method == "calibrated"  # the name asked for, on every screen
    assert per_call == engine.generate("abcabc", raw=True, max_new_tokens=3)
    plain.set_method("calibrated")
    assert plain.method == Uniform(factor=1.25)


def test_evaluation_specs_resolve_calibrated_for_the_model_named(shipped):
    CONFIG.save(shipped / "tiny-cal.json", base_model="tiny-cal")
    calibrated, on_pi = resolve_all(["calibrated", "cal-pi=calibrated+pi+random"], "tiny-cal")
    assert calibrated.name == "calibrated" and calibrated.method == CONFIG
    assert on_pi.name == "cal-pi" and on_pi.method == parse_method("calibrated+pi", "tiny-cal")
    assert on_pi.order == "random"


def test_no_shipped_config_names_the_calibrate_command_and_the_option(shipped):
    with pytest.raises(NoCalibratedMethodError) as error:
        rescale(named_tiny("tiny-cal"), "calibrated")
    message = str(error.value)
    assert "No calibrated method ships for the model 'tiny-cal'" in message
    assert "rag-mspoe calibrate search --model tiny-cal --space calibrated-reorder" in message
    assert "--out runs/calibrate-tiny-cal" in message
    assert "--method-config calibrated=runs/calibrate-tiny-cal/rag_mspoe_method.json" in message
    with pytest.raises(ValueError, match="'calibrated' is the config calibrated for one model"):
        parse_method("calibrated")


def test_a_config_calibrated_for_another_model_is_refused(shipped):
    CONFIG.save(shipped / "tiny-cal.json", base_model="other-model")
    with pytest.raises(NoCalibratedMethodError, match="was calibrated for 'other-model', not 'tiny-cal'"):
        parse_method("calibrated", "tiny-cal")


def test_each_shipped_config_is_for_an_embedded_model_and_has_its_validation_record():
    # A config ships only after it beat the unmodified model on questions it was not searched on;
    # the records and the summary of that validation ship beside the code, in docs/results/.
    from pathlib import Path

    from rag_mspoe.models.embedded_models import MODELS

    shipped = sorted(calibrated_configs.SEARCH_PATH[0].glob("*.json"))
    assert shipped, "the package ships calibrated configs"
    results = Path(__file__).resolve().parents[1] / "docs" / "results"
    for path in shipped:
        name = path.stem
        assert name in MODELS, f"{path.name} names no embedded model"
        assert calibrated_configs.calibrated_method(name) is not None
        summaries = [p for p in results.glob("*/README.md") if f"calibrated/{path.name}" in p.read_text()]
        assert summaries, f"no docs/results/*/README.md names the validation of calibrated/{path.name}"


def test_commands_default_to_the_method_shipped_for_the_model_or_none(shipped):
    assert calibrated_configs.default_method("tiny-cal") == "none"
    CONFIG.save(shipped / "tiny-cal.json", base_model="tiny-cal")
    assert calibrated_configs.default_method("tiny-cal") == "calibrated"
    assert calibrated_configs.default_method("org/tiny-cal") == "none"  # a hub id is never a shipped name


def test_the_default_applies_the_shipped_method_only_at_the_document_counts_it_won_at(shipped):
    path = CONFIG.save(shipped / "tiny-cal.json", base_model="tiny-cal")
    path.write_text(json.dumps({**json.loads(path.read_text()), "validated_documents": [20]}))
    assert calibrated_configs.default_method("tiny-cal", documents=20) == "calibrated"
    assert calibrated_configs.default_method("tiny-cal", documents=5) == "none"
    assert calibrated_configs.default_method("tiny-cal") == "calibrated"  # a server: counts vary, it warns


def test_ask_says_when_it_answers_without_the_shipped_method(shipped, tmp_path, capsys):
    path = CONFIG.save(shipped / "tiny-cal.json", base_model="tiny-cal")
    path.write_text(json.dumps({**json.loads(path.read_text()), "validated_documents": [20]}))
    folder = tmp_path / "tiny-cal"
    tiny_model("qwen2").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    argv = ["ask", "anything", "--index", str(tmp_path / "none"), "--model", str(folder)]
    # The index is missing, so the command stops after choosing the method.
    assert main([*argv, "-k", "5"]) == 1
    assert "without the method shipped for this model: it was not validated at 5" in capsys.readouterr().err
    assert main([*argv, "-k", "20", "--reorder"]) == 1
    assert "without the method shipped for this model: --reorder" in capsys.readouterr().err
    assert main([*argv, "-k", "20"]) == 1
    assert "without the method shipped" not in capsys.readouterr().err


def test_the_packages_own_defaults_are_the_shipped_methods():
    assert calibrated_configs.default_method("qwen2.5-coder-0.5b-instruct", documents=5) == "calibrated"
    assert calibrated_configs.default_method("qwen2.5-coder-1.5b-instruct", documents=20) == "calibrated"
    assert calibrated_configs.default_method("qwen2.5-coder-1.5b-instruct", documents=5) == "none"
    assert calibrated_configs.default_method("smollm2-135m-instruct") == "none"


def test_server_offers_calibrated_only_where_a_config_ships(shipped):
    pytest.importorskip("fastapi")
    from rag_mspoe.connectors.server import ModelRoutes

    tokenizer = tiny_tokenizer()
    engine = Engine(named_tiny("tiny-cal"), tokenizer, method="none")
    assert "tiny-cal+calibrated" not in ModelRoutes(engine).names()
    CONFIG.save(shipped / "tiny-cal.json", base_model="tiny-cal")
    routes = ModelRoutes(engine)
    assert "tiny-cal+calibrated" in routes.names()
    assert routes.method_for("tiny-cal+calibrated") == CONFIG


@pytest.mark.parametrize(
    "argv",
    [
        ["ask", "anything", "--index", "{tmp}/none", "--method", "calibrated"],
        ["demo", "--model", "smollm2-135m-instruct", "--methods", "none,calibrated"],
        ["serve", "--model", "{tmp}/tiny-cal", "--method", "calibrated"],
    ],
)
def test_commands_accept_calibrated_and_say_when_none_ships(shipped, tmp_path, capsys, argv):
    folder = tmp_path / "tiny-cal"
    tiny_model("qwen2").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    model = "tiny-cal" if "serve" in argv else "smollm2-135m-instruct"
    assert main([part.format(tmp=tmp_path) for part in argv]) == 1
    assert f"No calibrated method ships for the model {model!r}" in capsys.readouterr().err
