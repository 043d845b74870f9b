"""quantize="int8-prompt+int4": a prompt reads as int8-prompt reads it; every shorter call (a decoding
step, a drafted step's check) runs on the file's own 4-bit codes where its layers have them and on
the model's weights elsewhere; a model with nothing on a 4-bit grid is refused and left as it came.
"int8-prompt+int4-decoding": the same read, and every shorter call on codes (int8 off the grid) but
the output layer's.
"int8-decoding" / "int4-decoding": a prompt reads on the model's own weights, bit for bit; shorter
calls run on int8 codes / on the file's codes where it has them, in bf16 kernels in a float32 model."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file
from test_decode_with_drafts import drafted_from_the_prompt, greedy
from test_int4_grid import on_grid
from tiny_models import tiny_model, tiny_tokenizer
from torch import nn

from rag_mspoe.engine import Engine
from rag_mspoe.engine.engine_base import CODES_LOOKUP_TOKENS, PROMPT_LOOKUP_TOKENS
from rag_mspoe.models.grid_decoding import GridDecodingLinear
from rag_mspoe.models.int8_prompt import PROMPT_TOKENS, Int8PromptLinear
from rag_mspoe.models.quantization import (
    DECODING_KERNEL_DTYPE,
    INT4_DECODING,
    INT8_DECODING,
    INT8_PROMPT,
    INT8_PROMPT_INT4,
    INT8_PROMPT_INT4_DECODING,
    INT8_PROMPT_INT8,
    QuantizationError,
    quantization_census,
    quantization_of,
    quantize_model,
)
from rag_mspoe.models.weight_only import WeightOnlyLinear

# As a Q4_K_M file: these layers on a 4-bit grid, the up and down projections and the output layer not.
ON_GRID = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the model in float32, its folder): its ON_GRID layers' weights on a 4-bit grid, as saved."""
    folder = tmp_path_factory.mktemp("grid")
    model = tiny_model("llama", vocab_size=300, max_position_embeddings=256, initializer_range=0.3)
    state = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
    for name, tensor in state.items():
        if name.endswith(tuple(f"{layer}.weight" for layer in ON_GRID)):
            state[name] = on_grid(*tensor.shape, seed=len(name), dyadic=False) * 4  # large: a peaked output
    model.load_state_dict(state)
    save_file(state, folder / "model.safetensors")
    return model, folder


@pytest.fixture(scope="module")
def quantized(saved):
    model, folder = saved
    return quantize_model(copy.deepcopy(model), INT8_PROMPT_INT4, folder)


def test_layers_on_the_grid_decode_on_it_and_the_census_says_what_each_became(saved, quantized):
    model, _ = saved
    linears = {name for name, module in model.named_modules() if type(module) is nn.Linear}
    for name in linears:
        layer = quantized.get_submodule(name)
        if name.endswith(ON_GRID):
            assert isinstance(layer, GridDecodingLinear), name
            assert isinstance(layer.decoding, WeightOnlyLinear) and layer.decoding.bits == 4, name
            prompt_type = Int8PromptLinear if name.endswith("gate_proj") else nn.Linear
            assert type(layer.prompt_layer) is prompt_type, name
        elif name.endswith("up_proj"):
            assert isinstance(layer, Int8PromptLinear), name
        else:
            assert type(layer) is nn.Linear, name
    assert quantization_of(quantized) == INT8_PROMPT_INT4
    census = quantization_census(quantized)
    layers = model.config.num_hidden_layers
    assert census is not None
    assert {kind: counts["layers"] for kind, counts in census.items()} == {
        INT8_PROMPT_INT4: layers,  # gate projections
        "int4-decoding": 4 * layers,  # attention projections
        INT8_PROMPT: layers,  # up projections
        "none": layers + 1,  # down projections, output layer
    }


def stepped_after_an_int8_prompt_read(model, quantized, seed):
    """(`quantized`'s logits, int8-prompt's) at a step after a prompt both read, the prompt's
    logits checked equal."""
    int8_prompt = quantize_model(copy.deepcopy(model), INT8_PROMPT)
    ids = torch.randint(0, 300, (2, 3 * PROMPT_TOKENS), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        prompt = quantized(ids, use_cache=True)
        assert torch.equal(prompt.logits, int8_prompt(ids).logits)
        step = ids[:, -1:]
        ours = quantized(step, past_key_values=copy.deepcopy(prompt.past_key_values)).logits
        exact = int8_prompt(step, past_key_values=copy.deepcopy(prompt.past_key_values)).logits
    assert not torch.equal(ours, exact)  # another kernel
    return ours, exact


def test_a_prompt_reads_as_int8_prompt_and_a_step_computes_the_files_weights(saved, quantized):
    # In float32 the model's weights are the file's values: a step on the codes computes them.
    ours, exact = stepped_after_an_int8_prompt_read(saved[0], quantized, seed=0)
    torch.testing.assert_close(ours, exact, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def all_on_codes(saved):
    model, folder = saved
    return quantize_model(copy.deepcopy(model), INT8_PROMPT_INT4_DECODING, folder)


@pytest.mark.parametrize("scheme", [INT8_PROMPT_INT4, INT8_PROMPT_INT4_DECODING])
def test_drafted_answers_are_the_quantised_models_own_greedy_answers(scheme, quantized, all_on_codes):
    model = quantized if scheme == INT8_PROMPT_INT4 else all_on_codes
    generator = torch.Generator().manual_seed(5)
    for _ in range(3):
        ids = torch.randint(1, 300, (30,), generator=generator).tolist()
        ids = ids + ids[:12]  # its last tokens occurred before: a draft from the start
        drafted, reads = drafted_from_the_prompt(model, ids, 12)
        assert drafted == greedy(model, ids, 12)
        assert any(1 < rows <= PROMPT_TOKENS for rows in reads), reads  # drafts checked, on the codes


def test_all_but_the_output_layer_decode_on_codes_int8_off_the_grid(saved, all_on_codes):
    model, _ = saved
    linears = {name for name, module in model.named_modules() if type(module) is nn.Linear}
    for name in linears - {"lm_head"}:
        layer = all_on_codes.get_submodule(name)
        assert isinstance(layer, GridDecodingLinear), name
        assert layer.decoding.bits == (4 if name.endswith(ON_GRID) else 8), name
        in_int8 = name.endswith(("gate_proj", "up_proj"))
        assert type(layer.prompt_layer) is (Int8PromptLinear if in_int8 else nn.Linear), name
    census = quantization_census(all_on_codes)
    layers = model.config.num_hidden_layers
    assert census is not None and quantization_of(all_on_codes) == INT8_PROMPT_INT4_DECODING
    assert {kind: counts["layers"] for kind, counts in census.items()} == {
        INT8_PROMPT_INT4: layers,  # gate projections
        INT4_DECODING: 4 * layers,  # attention projections
        INT8_PROMPT_INT8: layers,  # up projections
        INT8_DECODING: layers,  # down projections
        "none": 1,  # the output layer: its int8 kernel reads a drafted check slower than bf16
    }
    assert type(all_on_codes.lm_head) is nn.Linear


def test_all_on_codes_reads_a_prompt_as_int8_prompt_and_steps_close_to_it(saved, all_on_codes):
    ours, exact = stepped_after_an_int8_prompt_read(saved[0], all_on_codes, seed=1)
    # bf16 kernels and int8 rounding off the grid, as the decoding schemes' test bounds them.
    assert (ours - exact).abs().max() < 0.05 * exact.abs().max()


@pytest.mark.parametrize(("scheme", "fix"), [(INT8_PROMPT_INT4, INT8_PROMPT), (INT4_DECODING, INT8_DECODING)])
def test_a_model_with_nothing_on_a_4_bit_grid_is_refused_and_left_as_it_came(scheme, fix):
    model = tiny_model("llama")
    layers = dict(model.named_modules())
    before = {name: p.clone() for name, p in model.named_parameters()}
    with pytest.raises(QuantizationError, match=f"no layer stored on a 4-bit grid.*--quantize {fix}\\.$"):
        quantize_model(model, scheme)
    assert quantization_of(model) is None
    assert all(layers[name] is module for name, module in model.named_modules())
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


@pytest.fixture(scope="module", params=[INT8_DECODING, INT4_DECODING])
def decoding(request, saved):
    """(the scheme, the float32 model quantised with it)."""
    model, folder = saved
    return request.param, quantize_model(copy.deepcopy(model), request.param, folder)


def test_decoding_schemes_wrap_every_layer_and_the_census_says_what_each_became(saved, decoding):
    model, _ = saved
    scheme, quantized = decoding
    linears = {name for name, module in model.named_modules() if type(module) is nn.Linear}
    for name in linears:
        layer = quantized.get_submodule(name)
        assert isinstance(layer, GridDecodingLinear) and type(layer.prompt_layer) is nn.Linear, name
        on_grid = scheme == INT4_DECODING and name.endswith(ON_GRID)
        assert layer.decoding.bits == (4 if on_grid else 8), name
        assert layer.decoding.scales.dtype == DECODING_KERNEL_DTYPE, name  # bf16 kernels, float32 model
    census = quantization_census(quantized)
    assert census is not None and quantization_of(quantized) == scheme
    layers = model.config.num_hidden_layers
    expected = (
        {INT4_DECODING: 5 * layers, INT8_DECODING: 2 * layers + 1}  # up, down, output layer off the grid
        if scheme == INT4_DECODING
        else {INT8_DECODING: 7 * layers + 1}
    )
    assert {kind: counts["layers"] for kind, counts in census.items()} == expected


def test_decoding_schemes_read_a_prompt_bit_for_bit_and_step_on_the_codes(saved, decoding):
    model, _ = saved
    _, quantized = decoding
    ids = torch.randint(0, 300, (2, 3 * PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        prompt = quantized(ids, use_cache=True)
        assert prompt.logits.dtype == torch.float32
        assert torch.equal(prompt.logits, model(ids).logits)
        step = ids[:, -1:]
        ours = quantized(step, past_key_values=copy.deepcopy(prompt.past_key_values)).logits
        exact = model(step, past_key_values=copy.deepcopy(prompt.past_key_values)).logits
    assert ours.dtype == torch.float32 and not torch.equal(ours, exact)
    # bf16 inputs and outputs, int8 rounding: about what a bf16 model's step moves on these peaked
    # outputs (0.10-0.62 of logits up to 7.8 on three prompts; these schemes 0.09-0.27).
    assert (ours - exact).abs().max() < 0.05 * exact.abs().max()


def test_a_decoding_layer_computes_its_codes_weights_in_bf16(saved):
    model, folder = saved
    quantized = quantize_model(copy.deepcopy(model), INT8_DECODING, folder)
    layer = quantized.get_submodule("model.layers.0.mlp.up_proj")
    weight = layer.prompt_layer.weight.detach()
    codes = layer.decoding.dequantized(torch.float32)
    # int8 codes on a bf16 scale per output channel: within half a step of the weight.
    steps = layer.decoding.scales.float()[:, None]
    assert ((codes - weight).abs() <= steps / 2 + 1e-6).all()
    x = torch.randn(3, weight.shape[1])
    with torch.inference_mode():
        out = layer(x)
    expected = x.to(torch.bfloat16).float() @ codes.T
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def test_drafted_answers_on_decoding_schemes_are_their_own_greedy_answers(decoding):
    _, quantized = decoding
    generator = torch.Generator().manual_seed(7)
    for _ in range(3):
        ids = torch.randint(1, 300, (30,), generator=generator).tolist()
        ids = ids + ids[:12]
        drafted, reads = drafted_from_the_prompt(quantized, ids, 12)
        assert drafted == greedy(quantized, ids, 12)
        assert any(1 < rows <= PROMPT_TOKENS for rows in reads), reads


def test_an_engine_decoding_on_the_codes_drafts_fewer_tokens(saved, tmp_path):
    # A check of many tokens costs the int4 kernel several single steps (docs/cpu-inference.md).
    model, _ = saved
    model.save_pretrained(tmp_path / "m")  # float32: the grid stays in the file
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    schemes = (INT8_PROMPT_INT4, INT8_PROMPT_INT4_DECODING, INT4_DECODING, INT8_DECODING, INT8_PROMPT)
    before = torch.get_num_threads()
    try:
        engines = {
            scheme: Engine.load(tmp_path / "m", threads=1, device="cpu", quantize=scheme)
            for scheme in schemes
        }
    finally:
        torch.set_num_threads(before)
    assert all(quantization_of(engine.model) == scheme for scheme, engine in engines.items())
    on_weights = engines.pop(INT8_PROMPT)
    assert {scheme: engine.prompt_lookup_tokens for scheme, engine in engines.items()} == CODES_LOOKUP_TOKENS
    assert max(CODES_LOOKUP_TOKENS.values()) < PROMPT_LOOKUP_TOKENS
    assert on_weights.prompt_lookup_tokens == PROMPT_LOOKUP_TOKENS
