"""Weight-only int4/int8 Linear layers: the kernels compute what their de-quantised weights give,
every Linear layer is replaced, and every method family acts on the quantised model as on the same
model holding the de-quantised weights."""

from __future__ import annotations

import copy

import pytest
import torch
from eval_run_helpers import embedded_tokenizer
from tiny_models import tiny_model
from torch import nn

from rag_mspoe import load_model
from rag_mspoe.engine import Engine
from rag_mspoe.models.quantization import quantization_census, quantization_of, quantize_model
from rag_mspoe.models.weight_only import KERNEL_ROWS, WeightOnlyLinear, int8_per_channel
from rag_mspoe.prompts.qa_prompt import render_qa_prompt

DOCUMENTS = [
    ("Rivers", "The Danube flows through ten countries before it reaches the Black Sea."),
    ("France", "Paris is the capital of France and its largest city."),
    ("Mountains", "Mont Blanc is the highest mountain in the Alps."),
    ("Deserts", "The Sahara is the largest hot desert in the world."),
]
PROMPT = render_qa_prompt("What is the capital of France?", DOCUMENTS)[0]
# One per method family: RoPE rescaling (per head, per layer, uniform), hidden-state scaling,
# attention calibration, PINE, and a reordering of the documents.
METHODS = ["mspoe", "layerwise", "pi", "hidden:7,-1", "attention-calibration", "pine", "invariant-reorder"]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("out_features", [96, 48])  # 48: int4 pads the kernel's blocks of 64 channels
def test_kernel_and_dequantised_paths_compute_the_dequantised_weights_product(bits, out_features):
    torch.manual_seed(0)
    linear = nn.Linear(64, out_features)
    layer = WeightOnlyLinear(linear, bits)
    weight = layer.dequantized(torch.float32)
    assert weight.shape == linear.weight.shape
    # int4 in groups of 32 moves a weight by at most half a step of its group; int8 much less.
    step = (linear.weight.max() - linear.weight.min()) / (15 if bits == 4 else 254)
    assert 0 < (weight - linear.weight).abs().max() <= step
    for rows in (1, KERNEL_ROWS[bits], KERNEL_ROWS[bits] + 1, 200):  # kernel, then de-quantised matmul
        x = torch.randn(2, rows, 64)
        torch.testing.assert_close(layer(x), x @ weight.T + linear.bias, atol=1e-4, rtol=1e-4)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    bf16 = WeightOnlyLinear(linear.to(torch.bfloat16), bits)
    reference = x.float() @ bf16.dequantized(torch.float32).T + bf16.bias.float()
    assert bf16(x).dtype == torch.bfloat16
    torch.testing.assert_close(bf16(x).float(), reference, atol=0.03, rtol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_codes_put_each_rows_largest_weight_at_127_and_the_rest_within_half_a_step(dtype):
    torch.manual_seed(0)
    weight = (torch.randn(5000, 48) * torch.logspace(-3, 1, 5000)[:, None]).to(dtype)  # two chunks
    weight[7] = 0  # an all-zero row keeps a tiny positive scale and zero codes
    kept = weight.clone()
    codes, scales = int8_per_channel(weight)
    assert torch.equal(weight, kept)  # quantising leaves the weight as it was
    assert codes.dtype == torch.int8 and scales.dtype == dtype and scales.shape == (5000,)
    assert (scales > 0).all() and not codes[7].any()
    largest = codes.abs().amax(1)
    assert (largest[torch.arange(5000) != 7] == 127).all()
    restored = codes.float() * scales.float()[:, None]
    assert ((restored - weight.float()).abs() <= scales.float()[:, None] / 2 * 1.0001).all()


def dequantised_copy(model, quantized):
    """`model` with each Linear weight replaced by what the quantised layer computes with."""
    reference = copy.deepcopy(model)
    layers = dict(quantized.named_modules())
    for name, module in reference.named_modules():
        if isinstance(module, nn.Linear):
            module.weight = nn.Parameter(layers[name].dequantized(torch.float32), requires_grad=False)
    return reference


@pytest.fixture(scope="module")
def models():
    tokenizer = embedded_tokenizer()
    # Large random weights give a peaked, varied distribution, so each method's change shows.
    model = tiny_model(
        "llama", vocab_size=len(tokenizer), max_position_embeddings=2048, initializer_range=0.3
    )
    pairs = {}
    for scheme in ("int4", "int8"):
        quantized = quantize_model(copy.deepcopy(model), scheme)
        pairs[scheme] = (quantized, dequantised_copy(model, quantized))
    return model, tokenizer, pairs


def test_every_linear_layer_is_replaced_the_output_layer_included(models):
    model, _, pairs = models
    linears = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    assert "lm_head" in linears and any(name.endswith("down_proj") for name in linears)
    for scheme, (quantized, _) in pairs.items():
        replaced = {name for name, m in quantized.named_modules() if isinstance(m, WeightOnlyLinear)}
        assert replaced == linears and quantization_of(quantized) == scheme
        assert not any(isinstance(m, nn.Linear) for m in quantized.modules())


@pytest.mark.parametrize("scheme", ["int4", "int8"])
@pytest.mark.parametrize("method", METHODS)
def test_each_method_acts_on_the_quantised_model_as_on_its_dequantised_weights(models, scheme, method):
    _, tokenizer, pairs = models
    quantized, reference = (Engine(m, tokenizer, method="none") for m in pairs[scheme])
    plain = quantized.score_continuations(PROMPT, [" Paris is the capital"])[0][0]
    score = quantized.score_continuations(PROMPT, [" Paris is the capital"], method=method)[0][0]
    expected = reference.score_continuations(PROMPT, [" Paris is the capital"], method=method)[0][0]
    assert abs(score - plain) > 1e-3, "the method must change the quantised model's score"
    assert score == pytest.approx(expected, abs=1e-3)
    answer = quantized.generate(PROMPT, method=method, max_new_tokens=8)  # prefill, then the kernels
    assert answer.text == reference.generate(PROMPT, method=method, max_new_tokens=8).text


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["int4", "int4-exact", "int8-prompt+int4"])
def test_embedded_qwen_answers_under_its_calibrated_method_quantised(scheme):
    try:
        model, tokenizer = load_model("qwen2.5-coder-0.5b-instruct", threads=1, quantize=scheme)
    except (RuntimeError, ValueError, OSError) as exc:
        pytest.skip(f"the embedded Qwen2.5-Coder-0.5B is not installed: {exc}")
    if scheme == "int4-exact":  # its Q4_K down projections; 896-input layers are Q5_0, others Q6_K/Q8_0
        census = quantization_census(model)
        assert census is not None and census["int4"]["layers"] == 12 and census["int8"]["layers"] == 157
    if (
        scheme == "int8-prompt+int4"
    ):  # the same 12 decode on their codes, the gate and up projections int8-prompt
        census = quantization_census(model)
        assert census is not None and census["int4-decoding"]["layers"] == 12
        assert census["int8-prompt"]["layers"] == 48 and "int8-prompt+int4" not in census
    engine = Engine(model, tokenizer, method="calibrated")
    answer = engine.generate(PROMPT, max_new_tokens=16)
    assert "paris" in answer.text.lower(), answer.text
