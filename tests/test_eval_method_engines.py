"""The evaluation method registry: spec strings, saved configs, prompt orders, RoPE-type model variants."""

from __future__ import annotations

import pytest
import torch
from tiny_models import prompt_ids, tiny_model, with_rope_parameters

from rag_mspoe import Compose, LayerWise, MsPoE, Uniform
from rag_mspoe.eval.method_engines import EngineSet
from rag_mspoe.methods.method_spec import ResolvedMethod, resolve, resolve_all
from rag_mspoe.rope.variants import rope_variant


def test_specs_name_model_methods_rope_types_and_orders():
    assert resolve("none") == ResolvedMethod("none")
    assert resolve("pi:2").method == Uniform(factor=2.0)
    assert resolve("mspoe:1.1-1.4").method == MsPoE(min_ratio=1.1, max_ratio=1.4)
    composed = resolve("layerwise+pi").method
    assert isinstance(composed, Compose)
    assert [type(m) for m in composed.methods] == [LayerWise, Uniform]
    ntk = resolve("dynamic-ntk:3+layerwise")
    assert ntk.rope_parameters == {"rope_type": "dynamic", "factor": 3.0}
    assert isinstance(ntk.method, LayerWise) and ntk.needs_variant
    assert resolve("yarn").rope_parameters == {"rope_type": "yarn", "factor": 2.0}
    assert resolve("longcontextreorder").order == "reorder" and not resolve("random").needs_variant
    assert resolve("mine=mspoe+random").name == "mine"
    assert resolve("hidden:7,-1").method.dimension == 7


def test_saved_config_is_a_method_and_round_trips(tmp_path):
    path = Uniform(factor=1.7).save(tmp_path / "cal.json")
    method = resolve(f"cal={path}+reorder")
    assert method.name == "cal" and method.method == Uniform(factor=1.7) and method.order == "reorder"
    assert ResolvedMethod.from_dict(method.to_dict()) == method
    assert resolve(str(path)).name == "uniform"  # unlabelled: named after its kind


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("warp-drive", "Unknown method"),
        ("reorder+random", "two document orders"),
        ("yarn+dynamic-ntk", "two RoPE types"),
        ("pi:fast", "not a number"),
        ("mspoe:1.5", "min-max"),
        ("yarn:0.5", "at least 1"),
    ],
)
def test_bad_specs_say_what_to_write(spec, message):
    with pytest.raises(ValueError, match=message):
        resolve(spec)


def test_method_names_must_be_unique():
    with pytest.raises(ValueError, match="label"):
        resolve_all(["pi", "pi"])


def test_longcontextreorder_puts_the_best_items_at_the_ends():
    items = ["best", "second", "third", "fourth", "worst"]
    ordered, indices = resolve("longcontextreorder").arrange(items, seed=0)
    assert {ordered[0], ordered[-1]} == {"best", "second"}
    assert ordered[len(items) // 2] == "worst"
    assert [items[i] for i in indices] == ordered


def test_random_order_is_a_seeded_permutation():
    method = resolve("random")
    items = list(range(20))
    first, _ = method.arrange(items, seed=1)
    assert first == method.arrange(items, seed=1)[0]
    assert sorted(first) == items and first != method.arrange(items, seed=2)[0]
    assert resolve("none").arrange(items, seed=1)[0] == items


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_rope_variant_shares_weights_and_matches_a_model_built_with_that_config(arch):
    model = tiny_model(arch, max_position_embeddings=32)
    ids = prompt_ids(48)
    with torch.no_grad():
        before = model(ids).logits
        variant = rope_variant(model, {"rope_type": "yarn", "factor": 2.0})
        reference = with_rope_parameters(model, rope_type="yarn", factor=2.0)
        assert torch.allclose(variant(ids).logits, reference(ids).logits, atol=1e-5)
        assert not torch.allclose(variant(ids).logits, before, atol=1e-3)
        assert torch.equal(model(ids).logits, before)  # the original is untouched
    assert variant.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()


def test_dynamic_ntk_changes_nothing_inside_the_trained_window():
    model = tiny_model("llama", max_position_embeddings=32)
    variant = rope_variant(model, {"rope_type": "dynamic", "factor": 2.0})
    with torch.no_grad():
        assert torch.equal(variant(prompt_ids(32)).logits, model(prompt_ids(32)).logits)
        assert not torch.allclose(variant(prompt_ids(64)).logits, model(prompt_ids(64)).logits, atol=1e-3)


def test_engine_set_builds_one_variant_per_rope_setting():
    model = tiny_model("llama")
    made = []
    engines = EngineSet(model, None, make_engine=lambda m, _t: made.append(m) or m)
    assert engines.engine_for(resolve("pi")) is model
    assert engines.engine_for(resolve("mspoe")) is model
    ntk = engines.engine_for(resolve("dynamic-ntk"))
    assert ntk is not model and engines.engine_for(resolve("dynamic-ntk+layerwise")) is ntk
    assert len(made) == 2
