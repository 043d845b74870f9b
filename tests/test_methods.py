"""Method configs: validation, JSON round trips, names."""

from __future__ import annotations

import json
import logging

import pytest

from rag_mspoe import (
    Compose,
    HiddenScale,
    LayerWise,
    MsPoE,
    Uniform,
    load_method,
    method_name,
    parse_method,
)
from rag_mspoe.rope.bezier import bezier_layer_factors

ROUND_TRIP = [
    Uniform(1.5, layers=[2, 3]),
    MsPoE(1.1, 2.0, skip_layers=3, alpha=2.5, gqa_policy="query_head"),
    MsPoE(head_order=[[1, 0], [0, 1]]),
    LayerWise(factors=[1.0, 1.2, 1.4]),
    LayerWise(control_points=[(0, 1.0), (0.5, 1.9), (1.0, 1.1)], x_is_fraction=True),
    Compose([LayerWise(factors=[1.0, 1.5]), Uniform(2.0)]),
    HiddenScale(dimension=7, factor=-1.0, layers=[3, 4, 5]),
]


@pytest.mark.parametrize("config", ROUND_TRIP, ids=lambda c: c.kind)
def test_save_and_load_round_trip(tmp_path, config):
    path = config.save(tmp_path / "adapter", base_model="smollm2-135m-instruct")
    assert path.name == "rag_mspoe_method.json"
    saved = json.loads(path.read_text())
    assert saved["base_model"] == "smollm2-135m-instruct" and saved["rag_mspoe_version"]
    assert load_method(tmp_path / "adapter") == config
    assert parse_method(str(path)) == config


def test_unknown_keys_are_ignored_with_a_warning(tmp_path, caplog):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"method": "uniform", "factor": 2.0, "future_option": 1}))
    with caplog.at_level(logging.WARNING):
        assert load_method(path) == Uniform(2.0)
    assert "future_option" in caplog.text


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Uniform(0.0), "factor must be a positive number"),
        (lambda: MsPoE(1.8, 1.2), "max_ratio .* must be at least min_ratio"),
        (lambda: MsPoE(gqa_policy="per_head"), "gqa_policy must be"),
        (lambda: MsPoE(head_order=[[0, 0]]), "not a permutation"),
        (lambda: LayerWise(), "exactly one of `factors` or `control_points`"),
        (lambda: LayerWise(factors=[1.0, -1.0]), r"factors\[1\] must be a positive"),
        (lambda: Compose([MsPoE(), MsPoE()]), "at most one MsPoE"),
    ],
)
def test_invalid_configs_say_what_is_wrong(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_files_say_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="No method config"):
        load_method(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_method(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"method": "lora"}))
    with pytest.raises(ValueError, match="Unknown method 'lora'.*mspoe"):
        load_method(tmp_path / "other.json")


def test_names():
    assert parse_method("none") is None and parse_method(None) is None
    assert parse_method("MsPoE") == MsPoE()
    assert parse_method("pi") == Uniform(1.5)
    assert method_name(parse_method("mspoe")) == "mspoe"
    assert method_name(MsPoE(1.0, 2.0)) == "mspoe"
    assert method_name(Compose([LayerWise(factors=[1.0]), Uniform(1.5)])) == "layerwise+pi"
    with pytest.raises(ValueError, match="Unknown method 'yarnish'.*mspoe"):
        parse_method("yarnish")


def test_bezier_factors_follow_the_curve():
    # A straight line from (0, 1) to (9, 2) gives evenly spaced factors.
    factors = bezier_layer_factors([(0, 1.0), (3, 4 / 3), (6, 5 / 3), (9, 2.0)], 10)
    assert factors == pytest.approx([1 + i / 9 for i in range(10)], abs=2e-3)
    stretched = LayerWise(control_points=[(0, 1.0), (1, 2.0)], x_is_fraction=True).layer_factors(5)
    assert stretched == pytest.approx([1.0, 1.25, 1.5, 1.75, 2.0], abs=2e-3)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0, -1.5, "big", True])
@pytest.mark.parametrize(
    "build, field",
    [
        (lambda v: Uniform(factor=v), "factor"),
        (lambda v: MsPoE(min_ratio=1.0, max_ratio=v), "max_ratio"),
        (lambda v: LayerWise(factors=[1.0, v]), r"factors\[1\]"),
        (lambda v: LayerWise(control_points=[(0, 1.0), (1, v)]), "control point y"),
    ],
)
def test_non_finite_non_positive_or_non_numeric_factors_are_refused_naming_the_field(build, field, value):
    if field == "control point y" and isinstance(value, str | bool):
        pytest.skip("control points are converted with float() first")
    with pytest.raises(ValueError, match=field):
        build(value)


def test_a_saved_config_with_an_absurd_factor_names_the_file_and_the_value(tmp_path):
    path = tmp_path / "huge.json"
    path.write_text('{"method": "uniform", "factor": 1e309}')  # JSON reads it as inf
    with pytest.raises(ValueError, match=r"huge\.json: factor must be a finite number, got inf"):
        load_method(path)
    path.write_text('{"method": "hidden", "dimension": 3, "factor": NaN}')
    with pytest.raises(ValueError, match="factor must be a finite number, got nan"):
        load_method(path)
