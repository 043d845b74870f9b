"""The one method-spec language: parse_method and resolve read the same grammar, per-call places
refuse what only evaluation can apply, and resolved methods travel between processes as they are."""

from __future__ import annotations

import pickle
import re

import pytest
from tiny_models import tiny_model

from rag_mspoe import Compose, LayerWise, MsPoE, Uniform, parse_method, rescale
from rag_mspoe.methods.method_spec import ResolvedMethod, known_names, resolve, resolve_all


def test_parse_method_reads_the_full_grammar_for_rescaling_parts(tmp_path):
    assert parse_method("pi:2") == Uniform(factor=2.0)
    assert parse_method("mspoe:1.1-1.4") == MsPoE(min_ratio=1.1, max_ratio=1.4)
    composed = parse_method("layerwise+pi")
    assert isinstance(composed, Compose)
    assert [type(m) for m in composed.methods] == [LayerWise, Uniform]
    assert parse_method("mine=pi:3") == Uniform(factor=3.0)
    assert parse_method("none+pi") == Uniform(factor=1.5)
    assert parse_method("none+baseline") is None
    path = Uniform(factor=1.7).save(tmp_path / "cal.json")
    assert parse_method(f"cal={path}+mspoe") == Compose([Uniform(factor=1.7), MsPoE()])
    assert parse_method("hidden:7,-1").dimension == 7


def test_a_saved_composition_joins_other_parts_flat_in_both_entry_points(tmp_path):
    path = Compose([LayerWise(factors=[1.0, 1.2, 1.4, 1.6]), Uniform(factor=1.5)]).save(tmp_path / "cal.json")
    flat = Compose([LayerWise(factors=[1.0, 1.2, 1.4, 1.6]), Uniform(factor=1.5), MsPoE()])
    assert parse_method(f"{path}+mspoe") == flat
    assert resolve(f"{path}+mspoe").method == flat
    saved = Compose([LayerWise(factors=[1.0, 1.2, 1.4, 1.6]), Uniform(factor=1.5)])
    assert parse_method(str(path)) == resolve(str(path)).method == saved


def test_a_saved_config_whose_path_holds_plus_or_equals_is_one_config(tmp_path):
    path = Uniform(factor=1.7).save(tmp_path / "a+b=c" / "method.json")
    assert parse_method(str(path)) == Uniform(factor=1.7)
    assert parse_method(path) == Uniform(factor=1.7)
    assert resolve(str(path)).method == Uniform(factor=1.7)


def test_names_win_over_folders_of_the_same_name(tmp_path, monkeypatch):
    (tmp_path / "pi").mkdir()
    monkeypatch.chdir(tmp_path)
    assert parse_method("pi") == Uniform(factor=1.5)
    assert resolve("pi").method == Uniform(factor=1.5)


@pytest.mark.parametrize(
    ("spec", "part", "kind"),
    [
        ("dynamic-ntk:2", "dynamic-ntk:2", "RoPE type"),
        ("pi+yarn", "yarn", "RoPE type"),
        ("mine=mspoe+longcontextreorder", "longcontextreorder", "document order"),
        ("random", "random", "document order"),
    ],
)
def test_per_call_places_refuse_model_variants_and_orders_naming_the_part(spec, part, kind):
    with pytest.raises(
        ValueError, match=re.escape(f"'{part}' (in '{spec}') is a {kind}") + ".*rag-mspoe sweep, e2e"
    ):
        parse_method(spec)
    with pytest.raises(ValueError, match=rf"'{part}'.*{kind}"):
        rescale(tiny_model("llama"), spec)
    resolve(spec)  # the evaluation commands take it


def test_both_entry_points_list_the_same_known_names():
    names = ", ".join(known_names())
    for parse in (parse_method, resolve):
        with pytest.raises(ValueError, match="Unknown method 'warp-drive'") as error:
            parse("warp-drive")
        assert names in str(error.value)
    assert {"none", "calibrated", "pi", "mspoe", "layerwise", "yarn", "longcontextreorder"} <= set(
        known_names()
    )


def test_arguments_only_where_a_name_takes_them():
    with pytest.raises(ValueError, match="'layerwise' takes no ':' argument"):
        parse_method("layerwise:2")
    with pytest.raises(ValueError, match="'none' takes no ':' argument"):
        resolve("none:2")


@pytest.mark.parametrize(
    "spec",
    ["none", "pi:2", "layerwise+pi", "mine=mspoe:1.1-1.4+random", "dynamic-ntk:3+layerwise", "hidden:7,-1"],
)
def test_resolved_methods_pickle_round_trip_equal(spec):
    method = resolve(spec)
    copied = pickle.loads(pickle.dumps(method))
    assert copied == method and type(copied) is ResolvedMethod
    assert copied.arrange(list(range(6)), seed=3) == method.arrange(list(range(6)), seed=3)


def test_resolve_all_passes_the_model_name_for_calibrated():
    with pytest.raises(ValueError, match="'calibrated' is the config calibrated for one model"):
        resolve_all(["none", "calibrated"])


@pytest.mark.parametrize("spec", ["mspoe+", "none+", "+pi", "mspoe++pi", "cal=pi+ "])
def test_an_empty_part_is_an_error_naming_it_even_beside_a_saved_config(spec, tmp_path, monkeypatch):
    MsPoE().save(tmp_path)  # a config in the working folder, which an empty part used to read
    monkeypatch.chdir(tmp_path)
    for parse in (parse_method, resolve):
        with pytest.raises(ValueError, match="has an empty part .* remove the stray '\\+'"):
            parse(spec)


@pytest.mark.parametrize("spec", ["none=pi", "baseline=mspoe", "pi=pi:2", "mspoe=mspoe+pi", "random=reorder"])
def test_a_method_name_cannot_label_another_method(spec):
    label = spec.partition("=")[0]
    with pytest.raises(ValueError, match=f"binds the method name '{label}' to another method"):
        resolve(spec)
    with pytest.raises(ValueError, match="Pick another label"):
        resolve_all(["none", spec])


@pytest.mark.parametrize(
    ("spec", "holds"),
    [
        ("pi:2=none", "':'"),
        ("mspoe+pi=none", "'+'"),
        ("pi:2=pi:3", "':'"),
        ("my:run=pi", "':'"),
        ("runs/cal=pi", "'/'"),
        ("cal.json=pi", "'.json'"),
    ],
)
def test_a_label_written_like_a_spec_cannot_label_another_method(spec, holds):
    label, _, body = spec.partition("=")
    for parse in (resolve, parse_method, lambda s: resolve_all(["none", s])):
        with pytest.raises(
            ValueError, match=re.escape(f"binds the label '{label}', written like a method spec")
        ) as error:
            parse(spec)
        assert f"(it holds {holds})" in str(error.value)
        assert "Pick a label without ':', '+', '/' or '.json'" in str(error.value)
        suggested = re.search(r"e\.g\. '(.+)'\.$", str(error.value))
        assert suggested is not None and resolve(suggested.group(1)).method == resolve(body).method


def test_a_label_that_spells_its_own_method_is_kept(tmp_path):
    assert resolve("pi:2=pi:2").name == "pi:2"
    assert resolve("mspoe+pi=mspoe+pi").method == parse_method("mspoe+pi")
    path = Uniform(factor=1.7).save(tmp_path / "cal.json")
    assert resolve(f"{path}={path}").method == Uniform(factor=1.7)


def test_a_method_name_may_label_its_own_method():
    assert resolve("none=baseline") == ResolvedMethod(name="none")
    assert resolve("pi=pi:1.5").method == Uniform(factor=1.5)
    assert resolve("reorder=longcontextreorder").order == "reorder"
    assert resolve("my-none=pi").name == "my-none"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("ntk:nan", "'nan' is not a number; write a finite one in plain digits"),
        ("yarn:nan", "'nan' is not a number"),
        ("dynamic-ntk:inf", "'inf' is not a number"),
        ("dynamic-ntk:1e400", "'1e400' is not a number"),
        ("pine:nan", "'nan' is not a number"),
        ("pi: 2", "' 2' is not a number; write a finite one in plain digits"),
        ("pi:\uff12", "'\uff12' is not a number; write a finite one in plain digits"),  # a full-width 2
        ("pi:1_0", "'1_0' is not a number"),
        ("pi:1e-300", "'pi:1e-300': factor must be at least 1e-06"),
        ("mspoe:1e-9-2", "min_ratio must be at least 1e-06"),
        ("mspoe:-1", "give Ms-PoE's ratio range as min-max"),
        ("mspoe:-1-2", "'mspoe:-1-2': min_ratio must be a positive number"),
    ],
)
def test_method_arguments_are_finite_plain_numbers_in_range(spec, message):
    for parse in (resolve, parse_method):
        with pytest.raises(ValueError, match=re.escape(message)):
            parse(spec)


def test_ms_poe_ranges_split_between_numbers_not_at_a_sign():
    assert parse_method("mspoe:1e-1-2") == MsPoE(min_ratio=0.1, max_ratio=2.0)
    assert parse_method("mspoe:1-2.5") == MsPoE(min_ratio=1.0, max_ratio=2.5)


@pytest.mark.parametrize(
    "spec", ["x" * 10_000, "pi+" + "x" * 10_000, "a=" + "y" * 10_000 + ".json", "a\x00b+pi"]
)
def test_a_spec_no_file_system_can_look_up_is_a_message_not_an_os_error(spec):
    with pytest.raises(ValueError) as error:
        resolve(spec)
    assert len(str(error.value)) < 2000


def test_a_plus_inside_a_number_does_not_join_parts():
    # Found by tests/test_fuzz_properties.py: Python writes 1e16 as '1e+16'.
    assert parse_method("pi:1e+16") == Uniform(factor=1e16)
    assert parse_method("pi:+2") == Uniform(factor=2.0)
    assert resolve("mspoe:1e+0-2e+0+pi:2").method == Compose(
        [MsPoE(min_ratio=1.0, max_ratio=2.0), Uniform(2.0)]
    )
