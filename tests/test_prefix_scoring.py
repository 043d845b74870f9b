"""Scoring many prompts at once with their common starts computed once (Engine.score_prompts):
the same scores as one full forward per option (fp32 tiny models of every cache kind, every
method), less work where prompts share a start, and the real embedded model in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
from scoring_reference import reference_loglikelihood
from tiny_models import tiny_model

from rag_mspoe import load_model
from rag_mspoe.engine import Engine
from rag_mspoe.engine.prefix_scoring import shares_prefixes
from rag_mspoe.eval.data.prompts import qa_prompt
from rag_mspoe.eval.data.records import with_gold_at
from rag_mspoe.eval.data.synthetic import generate_invented_qa
from rag_mspoe.methods import Compose, HiddenScale, LayerWise, MsPoE, Uniform
from rag_mspoe.prompts.chat_template import render

# Per-token tolerance of the fp32 comparisons, in nats.
FP32_TOLERANCE = 1e-4


def static_mspoe(model):
    config = model.config
    heads = config.num_key_value_heads
    order = [[(head + layer) % heads for head in range(heads)] for layer in range(config.num_hidden_layers)]
    return MsPoE(head_order=order)


def sweep_items(examples, positions):
    """The prompts of a gold-position sweep with their forced-choice options, example by example."""
    return [
        (qa_prompt(with_gold_at(example, position)), list(example.candidates))
        for example in examples
        for position in positions
    ]


def forward_shapes(model):
    """A list that receives the [rows, tokens] shape of the input of every forward of the model."""
    seen = []
    model.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(tuple(kwargs.get("input_ids", args[0] if args else None).shape)),
        with_kwargs=True,
    )
    return seen


@pytest.fixture(scope="module")
def tokenizer(embedded):
    return embedded[1]


@pytest.fixture(scope="module")
def examples():
    return generate_invented_qa(4, 2, seed=3)


CASES = [
    *[("llama", method) for method in ("none", "pi:2", "layerwise", "static-mspoe", "layerwise+pi", "mspoe")],
    *[(arch, method) for arch in ("qwen2", "gemma3_text") for method in ("none", "static-mspoe")],
]


@pytest.mark.parametrize(("arch", "method"), CASES)
def test_shared_starts_give_the_full_forward_scores(tokenizer, examples, arch, method):
    # Large random weights give sharp attention, so a wrong position or cache shows in the scores.
    # qwen2 and gemma3 have sliding-window layers with a 12-token window: their caches drop tokens.
    model = tiny_model(arch, vocab_size=len(tokenizer), max_position_embeddings=1024, initializer_range=0.3)
    engine = Engine(model, tokenizer, name=f"tiny-{arch}")
    spec = static_mspoe(model) if method == "static-mspoe" else method
    items = sweep_items(examples, (0, 2, 3))
    items.append(items[1])  # the same prompt twice: two ends at one node of the trie
    scored = engine.score_prompts(items, method=spec)
    for (prompt, options), scores in zip(items, scored, strict=True):
        reference = reference_loglikelihood(engine, prompt, options, method=spec)
        for (total, tokens), expected in zip(scores, reference, strict=True):
            assert abs(total - expected) / tokens < FP32_TOLERANCE, (prompt[:40], total, expected)


def test_each_shared_start_is_computed_once(tokenizer, examples):
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=1024)
    engine = Engine(model, tokenizer, name="tiny-llama")
    items = sweep_items(examples, (0, 2, 3))
    prompts = [render(tokenizer, prompt) for prompt, _ in items]
    trie_nodes = {tuple(ids[:end]) for ids in prompts for end in range(1, len(ids) + 1)}
    seen = forward_shapes(model)
    engine.score_prompts(items, method="pi:2")
    # Prompt forwards have one row; each prompt's options run as one batch of several rows.
    assert sum(length for rows, length in seen if rows == 1) == len(trie_nodes)
    assert sum(rows > 1 for rows, _ in seen) == len(items)
    assert len(trie_nodes) < 0.8 * sum(len(ids) for ids in prompts)
    seen.clear()
    engine.score_prompts(items, method="mspoe")  # per-prompt Ms-PoE: every prompt in full
    assert sum(length for rows, length in seen if rows == 1) == sum(len(ids) for ids in prompts)


def test_which_methods_share_prefixes(tokenizer):
    assert shares_prefixes(None)
    assert shares_prefixes(Uniform(factor=2.0))
    assert shares_prefixes(LayerWise(factors=[1.0, 1.5]))
    assert shares_prefixes(MsPoE(head_order=[[0, 1]]))
    assert shares_prefixes(Compose(methods=[LayerWise(factors=[1.0, 1.5]), MsPoE(head_order=[[1, 0]])]))
    assert not shares_prefixes(MsPoE())  # ranks its heads on the prompt's last token
    assert not shares_prefixes(Compose(methods=[Uniform(factor=2.0), MsPoE()]))
    assert not shares_prefixes(HiddenScale(dimension=3, factor=0.0))  # recomputes the prompt's last rows
    model = tiny_model("llama", vocab_size=len(tokenizer))
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert not shares_prefixes(None, model.config)  # frequencies chosen by the sequence's length


def test_the_embedded_model_scores_a_sweep_the_same_way(examples):
    model, tokenizer = load_model(dtype="float32")
    engine = Engine(model, tokenizer, method="none")
    items = sweep_items(examples[:1], (0, 3))
    scored = engine.score_prompts(items, method="layerwise")
    for (prompt, options), scores in zip(items, scored, strict=True):
        full = engine.score_continuations(prompt, options, method="layerwise")
        for (total, tokens), (expected, expected_tokens) in zip(scores, full, strict=True):
            assert tokens == expected_tokens
            assert abs(total - expected) / tokens < 1e-3, (total, expected)


def test_in_bf16_sharing_adds_no_error_beyond_bf16s_own(examples):
    # bf16 rounds every layer's output, and the CPU's kernels round differently for different
    # shapes, so the same prompt scored in one forward or in pieces differs by up to ~0.15
    # nats/token on this model whichever way it is cut. Both paths must stay as close to fp32.
    items = sweep_items(examples[:1], (0, 3))
    reference = Engine(*load_model(dtype="float32"), method="none").score_prompts(items, method="layerwise")
    model, tokenizer = load_model(dtype="bfloat16")
    engine = Engine(model, tokenizer, method="none")
    shared = engine.score_prompts(items, method="layerwise")
    plain = [engine.score_continuations(prompt, options, method="layerwise") for prompt, options in items]

    def error(scores):
        pairs = [
            (a, r) for row, ref in zip(scores, reference, strict=True) for a, r in zip(row, ref, strict=True)
        ]
        return sum(abs(a[0] - r[0]) / r[1] for a, r in pairs) / len(pairs)

    assert model.dtype == torch.bfloat16
    assert error(shared) < 1.5 * error(plain) + 0.01, (error(shared), error(plain))
