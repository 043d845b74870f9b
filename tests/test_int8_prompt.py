"""quantize="int8-prompt": the MLP's gate and up projections read a prompt's many tokens in int8
(activations per row, weights per output channel) and every shorter call on the layer's own
weight, so decoding, drafting and the methods act as on the unquantised model."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from forward_counts import counted_forwards
from test_prompt_lookup import PROMPTS
from tiny_models import tiny_model
from torch import nn

from rag_mspoe import load_model
from rag_mspoe.engine import Engine
from rag_mspoe.engine.engine_base import PROMPT_LOOKUP_TOKENS
from rag_mspoe.models.int8_prompt import PROMPT_TOKENS, Int8PromptLinear
from rag_mspoe.models.quantization import (
    INT8_PROMPT,
    QuantizationError,
    quantization_census,
    quantization_of,
    quantize_model,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_reads_int8_and_a_short_call_reads_the_weight_itself(dtype):
    torch.manual_seed(0)
    linear = nn.Linear(96, 40).to(dtype)
    layer = Int8PromptLinear(linear)
    for tokens in (1, PROMPT_LOOKUP_TOKENS + 1, PROMPT_TOKENS):
        x = torch.randn(3, tokens, 96, dtype=dtype)
        assert torch.equal(layer(x), linear(x)), tokens
    x = torch.randn(2, PROMPT_TOKENS + 1, 96, dtype=dtype)
    out, exact = layer(x), linear(x)
    assert out.dtype == dtype and out.shape == exact.shape and not torch.equal(out, exact)
    # int8 rows and weights: a product moves by about a percent of the outputs' range, no more.
    largest = exact.float().abs().max()
    assert (out.float() - exact.float()).abs().max() < 0.03 * largest
    # Each row on its own step: a sequence reads the same alone as next to another one.
    torch.testing.assert_close(layer(x[:1]), out[:1], rtol=0, atol=0)


def test_the_drafted_check_stays_on_the_weight():
    # A drafted step checks the drafted tokens and one more in one call: it must decode as greedy does.
    assert PROMPT_LOOKUP_TOKENS + 1 <= PROMPT_TOKENS


@pytest.fixture(scope="module")
def tiny_pair():
    # Large random weights give a peaked, varied distribution, so a moved product shows.
    model = tiny_model("llama", vocab_size=300, max_position_embeddings=256, initializer_range=0.3)
    return model, quantize_model(copy.deepcopy(model), INT8_PROMPT)


def test_only_the_gate_and_up_projections_change_and_the_census_says_so(tiny_pair):
    model, quantized = tiny_pair
    changed = {name for name, module in quantized.named_modules() if isinstance(module, Int8PromptLinear)}
    linears = {name for name, module in model.named_modules() if type(module) is nn.Linear}
    assert changed == {name for name in linears if name.endswith(("gate_proj", "up_proj"))}
    assert quantization_of(quantized) == INT8_PROMPT
    census = quantization_census(quantized)
    assert census[INT8_PROMPT]["layers"] == 2 * model.config.num_hidden_layers
    assert census[INT8_PROMPT]["layers"] + census["none"]["layers"] == len(linears)
    weights = sum(model.get_parameter(f"{name}.weight").numel() for name in linears)
    assert census[INT8_PROMPT]["weights"] + census["none"]["weights"] == weights


def test_a_prompt_read_in_pieces_gives_the_rows_read_whole(tiny_pair):
    # A kept prefix's rows are reused under a new question: per-row steps make them what a whole read gives.
    _, quantized = tiny_pair
    ids = torch.randint(0, 300, (1, 2 * PROMPT_TOKENS + 6))
    with torch.inference_mode():
        whole = quantized(ids).logits
        first = quantized(ids[:, : PROMPT_TOKENS + 3], use_cache=True)
        rest = quantized(ids[:, PROMPT_TOKENS + 3 :], past_key_values=first.past_key_values).logits
    torch.testing.assert_close(torch.cat([first.logits, rest], 1), whole, rtol=1e-4, atol=1e-4)


def test_decoding_after_the_prompt_runs_the_unquantised_weights(tiny_pair):
    model, quantized = tiny_pair
    ids = torch.randint(0, 300, (2, 3 * PROMPT_TOKENS))
    with torch.inference_mode():
        prompt = quantized(ids, use_cache=True)
        exact = model(ids).logits
        # The prompt's logits moved, a little (a few percent on this tiny model's large random weights).
        moved = (prompt.logits - exact).abs().mean()
        assert 0 < moved < 0.1 * exact.abs().mean()
        # A step on the quantised model's cache computes what the unquantised model computes on it.
        step = ids[:, -1:]
        ours = quantized(step, past_key_values=copy.deepcopy(prompt.past_key_values)).logits
        theirs = model(step, past_key_values=copy.deepcopy(prompt.past_key_values)).logits
    assert torch.equal(ours, theirs)


def test_a_model_without_gate_and_up_projections_is_refused_with_the_fix():
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=50, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    before = {name: p.clone() for name, p in model.named_parameters()}
    with pytest.raises(QuantizationError, match="no MLP layer named gate_proj or up_proj.*--quantize int8"):
        quantize_model(model, INT8_PROMPT)
    assert quantization_of(model) is None
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


@pytest.fixture(scope="module")
def embedded_int8_prompt():
    return load_model(threads=1, quantize=INT8_PROMPT)


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_embedded_drafted_answers_are_its_own_greedy_answers(prompt):
    # In float32: bf16 logits tie often enough that an 11-row and a 1-row read can pick apart
    # (so can the unquantised bf16 model's); what is tested is that drafted rows read the weights
    # greedy decoding reads, never the prompt's int8 path.
    engine = Engine(*load_model(threads=1, dtype=torch.float32, quantize=INT8_PROMPT), method="none")
    engine.prompt_lookup_tokens = 0
    plain, plain_counts = counted_forwards(engine, lambda: engine.generate(prompt, max_new_tokens=40))
    engine.prompt_lookup_tokens = PROMPT_LOOKUP_TOKENS
    drafted, drafted_counts = counted_forwards(engine, lambda: engine.generate(prompt, max_new_tokens=40))
    assert drafted == plain and drafted_counts.forwards < plain_counts.forwards


@pytest.mark.slow
def test_embedded_model_answers_and_scores_close_to_bf16_and_the_methods_act(embedded, embedded_int8_prompt):
    question, answer = PROMPTS[1], " Maren Holt kept the light."
    quantized = Engine(*embedded_int8_prompt)
    assert "holt" in quantized.generate(question, max_new_tokens=12).text.lower()
    (total, tokens), (reference, _) = (
        Engine(*model).score_continuations(question, [answer])[0]
        for model in (embedded_int8_prompt, embedded)
    )
    assert total != reference  # the prompt's read moved ...
    # ... a little (0.065 nats/token here; real prompts of the Qwen models: docs/cpu-inference.md).
    assert abs(total - reference) / tokens < 0.15
    for method in ("mspoe", "layerwise", "hidden:7,-1"):
        (moved, _), (exact, _) = (
            Engine(*model, method=method).score_continuations(question, [answer])[0]
            for model in (embedded_int8_prompt, embedded)
        )
        assert moved not in (total, exact), method  # the method acts on the quantised model
