"""Numerical behaviour of every method on tiny random models of every supported architecture."""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers
from tiny_models import ARCH_NAMES, prompt_ids, tiny_model, with_rope_parameters

from rag_mspoe import (
    ARCHITECTURES,
    Compose,
    LayerWise,
    MsPoE,
    Uniform,
    UnsupportedArchitectureError,
    frozen_head_order,
    head_ratios,
    rescale,
    rescaled,
    unrescale,
)
from rag_mspoe.rope.hooks import cache_argument, returned_cache

METHODS = {
    "uniform": Uniform(1.7),
    "uniform-some-layers": Uniform(2.5, layers=[1, 3]),
    "layerwise": LayerWise(factors=[1.0, 1.4, 2.2, 1.6]),
    "layerwise-bezier": LayerWise(control_points=[(0, 1.0), (1, 2.0), (2, 1.5), (3, 1.2)]),
    "mspoe": MsPoE(1.2, 2.4, skip_layers=1),
    "mspoe-query-head": MsPoE(1.2, 2.4, skip_layers=1, gqa_policy="query_head"),
    "mspoe-static": MsPoE(1.2, 2.4, skip_layers=1, head_order=[[0, 1], [1, 0], [0, 1], [1, 0]]),
    "layerwise+pi": Compose([LayerWise(factors=[1.0, 1.4, 2.2, 1.6]), Uniform(1.5)]),
    "mspoe+layerwise": Compose([MsPoE(1.2, 2.4, skip_layers=1), LayerWise(factors=[1.0, 1.4, 2.2, 1.6])]),
}


def logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


def decode_step_by_step(model, ids, prompt_length):
    """Prefill the prompt, then feed the rest one token at a time through the KV cache."""
    with torch.no_grad():
        out = model(ids[:, :prompt_length], use_cache=True)
        steps = [out.logits]
        cache = returned_cache(out)
        for t in range(prompt_length, ids.shape[1]):
            out = model(ids[:, t : t + 1], **cache_argument(cache), use_cache=True)
            cache = returned_cache(out)
            steps.append(out.logits)
    return torch.cat(steps, dim=1)


@pytest.fixture(params=ARCH_NAMES)
def arch(request):
    return request.param


@pytest.mark.parametrize(
    "method", [Uniform(1.0), LayerWise(factors=[1.0] * 4), MsPoE(1.0, 1.0, skip_layers=0)]
)
def test_all_ratios_one_is_identical_to_unmodified(arch, method):
    model = tiny_model(arch)
    ids = prompt_ids()
    base = logits(model, ids)
    with rescaled(model, method):
        assert torch.equal(logits(model, ids), base)


@pytest.mark.parametrize("factor", [1.5, 3.0])
def test_uniform_equals_transformers_linear_scaling(arch, factor):
    model = tiny_model(arch)
    linear = with_rope_parameters(model, rope_type="linear", factor=factor)
    ids = prompt_ids()
    expected = logits(linear, ids)
    assert not torch.allclose(expected, logits(model, ids), atol=1e-3)  # the factor matters
    with rescaled(model, Uniform(factor)):
        torch.testing.assert_close(logits(model, ids), expected, atol=2e-5, rtol=1e-4)


def test_layerwise_constant_and_mspoe_equal_ratios_equal_uniform(arch):
    model = tiny_model(arch)
    ids = prompt_ids()
    with rescaled(model, Uniform(1.8)):
        uniform = logits(model, ids)
    with rescaled(model, LayerWise(factors=[1.8] * 4)):
        torch.testing.assert_close(logits(model, ids), uniform, atol=1e-6, rtol=0)
    for policy in ("kv_group", "query_head"):
        with rescaled(model, MsPoE(1.8, 1.8, skip_layers=0, gqa_policy=policy)):
            torch.testing.assert_close(logits(model, ids), uniform, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_cached_decoding_matches_full_forward(arch, attn, name):
    model = tiny_model(arch, attn=attn)
    ids = prompt_ids(length=24)
    prompt_length = 16
    base = logits(model, ids)
    with rescaled(model, METHODS[name]):
        stepwise = decode_step_by_step(model, ids, prompt_length)
        # One forward over prompt + continuation; Ms-PoE keeps the head order of the prompt.
        with frozen_head_order(model):
            full = logits(model, ids)
    assert not torch.allclose(full, base, atol=1e-4), "the method must change the outputs"
    torch.testing.assert_close(stepwise, full, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["uniform", "layerwise", "mspoe", "mspoe-query-head", "mspoe+layerwise"])
def test_left_padded_batch_matches_each_prompt_alone(arch, name):
    model = tiny_model(arch)
    long, short = prompt_ids(length=20, seed=2)[0], prompt_ids(length=13, seed=3)[0]
    ids = torch.zeros(2, 20, dtype=torch.long)
    mask = torch.zeros(2, 20, dtype=torch.long)
    ids[0], mask[0] = long, 1
    ids[1, 7:], mask[1, 7:] = short, 1
    kwargs = dict(
        max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True
    )
    with rescaled(model, METHODS[name]), torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, **kwargs)
        alone = [
            model.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), **kwargs)
            for p in (long, short)
        ]
    for row, single in enumerate(alone):
        torch.testing.assert_close(batch.sequences[row, -4:], single.sequences[0, -4:])
        for step_batch, step_single in zip(batch.logits, single.logits, strict=True):
            torch.testing.assert_close(step_batch[row], step_single[0], atol=5e-5, rtol=1e-4)


def _expected_awareness(model, ids, layer, alpha=3.0):
    """Eq. 1 from the full T x T pre-RoPE attention of the unmodified model (the reference's way)."""
    captured = {}
    attention = model.model.layers[layer].self_attn
    hooks = [
        attention.q_proj.register_forward_hook(lambda m, i, o: captured.__setitem__("q", o)),
        attention.k_proj.register_forward_hook(lambda m, i, o: captured.__setitem__("k", o)),
    ]
    logits(model, ids)
    for hook in hooks:
        hook.remove()
    d = attention.head_dim
    q = captured["q"].view(1, -1, model.config.num_attention_heads, d).transpose(1, 2)
    k = captured["k"].view(1, -1, model.config.num_key_value_heads, d).transpose(1, 2)
    k = k.repeat_interleave(attention.num_key_value_groups, dim=1)
    t = ids.shape[1]
    full = q @ k.transpose(-1, -2) * attention.scaling
    full = full.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    last = full[0, :, -1]  # [Hq, T]
    return (last >= alpha * last.mean(-1, keepdim=True)).float().mean(-1)


@pytest.mark.parametrize("policy", ["kv_group", "query_head"])
def test_most_position_aware_head_gets_min_ratio(policy):
    model = tiny_model("llama", seed=5)
    ids = prompt_ids(length=40, seed=7)
    layer = 2
    with torch.no_grad():  # a random model attends almost uniformly; sharpen it so heads differ
        torch.nn.init.normal_(model.model.layers[layer].self_attn.q_proj.weight, std=0.3)
        torch.nn.init.normal_(model.model.layers[layer].self_attn.k_proj.weight, std=0.3)
    scores = _expected_awareness(model, ids, layer)
    if policy == "kv_group":
        scores = scores.view(model.config.num_key_value_heads, -1).mean(-1)
    assert scores.max() > scores.min(), "the check needs heads that differ"
    with rescaled(model, MsPoE(1.2, 1.8, skip_layers=0, gqa_policy=policy)):
        logits(model, ids)
        ratios = head_ratios(model)[layer][0]
    assert ratios[int(scores.argmax())] == pytest.approx(1.2)
    ranked = torch.argsort(-scores, stable=True)  # ties keep head order
    assert ratios[ranked[-1]] == pytest.approx(1.8)
    assert torch.all(ratios[ranked][1:] > ratios[ranked][:-1])


def test_static_order_assigns_ratios_by_given_rank():
    model = tiny_model("llama")
    rescale(model, MsPoE(1.2, 1.8, skip_layers=0, head_order=[[1, 0]] * 4))
    ratios = head_ratios(model)
    unrescale(model)
    assert ratios[0].tolist() == [[pytest.approx(1.8), pytest.approx(1.2)]]


@pytest.mark.parametrize("name", sorted(METHODS))
def test_unrescale_restores_outputs_exactly(arch, name):
    model = tiny_model(arch)
    modeling = importlib.import_module(ARCHITECTURES[arch].modeling_module)
    original_rotary = modeling.apply_rotary_pos_emb
    ids = prompt_ids()
    base = logits(model, ids)
    rescale(model, METHODS[name])
    changed = logits(model, ids)
    unrescale(model)
    assert not torch.equal(changed, base)
    assert torch.equal(logits(model, ids), base)
    assert modeling.apply_rotary_pos_emb is original_rotary
    assert all(m.num_key_value_groups == 2 for m in (layer.self_attn for layer in model.model.layers))


def test_second_rescale_replaces_the_first_with_a_warning(caplog):
    model = tiny_model("llama")
    ids = prompt_ids()
    with rescaled(model, Uniform(2.0)):
        expected = logits(model, ids)
    rescale(model, MsPoE())
    rescale(model, Uniform(2.0))
    assert "already rescaled" in caplog.text
    torch.testing.assert_close(logits(model, ids), expected, atol=0, rtol=0)
    unrescale(model)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256},
        {
            "rope_type": "llama3",
            "factor": 2.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
@pytest.mark.parametrize("name", ["mspoe", "layerwise+pi"])
def test_combines_with_the_models_own_rope_type(rope, name):
    model = with_rope_parameters(tiny_model("llama"), **rope)
    ids = prompt_ids(length=24)
    base = logits(model, ids)
    with rescaled(model, METHODS[name]):
        stepwise = decode_step_by_step(model, ids, 16)
        with frozen_head_order(model):
            full = logits(model, ids)
    assert not torch.allclose(full, base, atol=1e-4)
    torch.testing.assert_close(stepwise, full, atol=5e-5, rtol=1e-4)


def test_uniform_on_linear_model_multiplies_factors():
    model = tiny_model("llama")
    ids = prompt_ids()
    linear = with_rope_parameters(model, rope_type="linear", factor=1.5)
    doubled = with_rope_parameters(model, rope_type="linear", factor=3.0)
    with rescaled(linear, Uniform(2.0)):
        torch.testing.assert_close(logits(linear, ids), logits(doubled, ids), atol=2e-5, rtol=1e-4)


def test_unsupported_architecture_names_the_supported_ones():
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(UnsupportedArchitectureError, match="gpt2.*llama.*mistral.*qwen2.*qwen3"):
        rescale(model, MsPoE())


def test_layer_count_mismatch_is_a_clear_error():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="3 factors but the model has 4 layers"):
        rescale(model, LayerWise(factors=[1.0, 1.2, 1.4]))
    with pytest.raises(ValueError, match="head_order has 2 layers; the model has 4"):
        rescale(model, MsPoE(head_order=[[0, 1], [1, 0]]))
    assert not hasattr(model, "_rag_mspoe_state")


def test_decoding_without_prefill_is_a_clear_error():
    model = tiny_model("llama")
    ids = prompt_ids()
    with torch.no_grad():
        cache = returned_cache(model(ids, use_cache=True))  # prefilled while unmodified
        with rescaled(model, MsPoE()), pytest.raises(RuntimeError, match="Run the prompt through"):
            model(ids[:, :1], **cache_argument(cache), use_cache=True)


@pytest.mark.parametrize("name", ["mspoe", "mspoe-query-head", "layerwise"])
def test_one_prefill_continued_several_ways_matches_each_alone(name):
    """Scoring several continuations of one prompt from one cached prefill (as eval does)."""
    model = tiny_model("qwen3")
    prompt = prompt_ids(length=16)
    continuations = prompt_ids(length=4, batch=3, seed=9)
    with rescaled(model, METHODS[name]), torch.no_grad():
        cache = returned_cache(model(prompt, use_cache=True))
        cache.batch_repeat_interleave(3)
        together = model(continuations, **cache_argument(cache), use_cache=True).logits
        for row in range(3):
            alone = decode_step_by_step(model, torch.cat([prompt, continuations[row : row + 1]], dim=1), 16)
            torch.testing.assert_close(together[row], alone[0, 16:], atol=5e-5, rtol=1e-4)
