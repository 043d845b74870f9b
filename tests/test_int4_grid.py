"""int4-exact: a weight stored on a 4-bit grid (as a GGUF Q4_K/Q4_1 tensor de-quantised to float32)
comes back bit-exactly from the int4 layer; a weight off the grid goes to the fallback; the grid
is read from the saved float32 file, not from the model's bf16 copy."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import tiny_model
from torch import nn

from rag_mspoe.models.int4_grid import int4_grid
from rag_mspoe.models.quantization import quantization_census, quantize_model
from rag_mspoe.models.weight_only import KERNEL_ROWS, WeightOnlyLinear


def on_grid(rows: int, inputs: int, seed: int = 0, dyadic: bool = True) -> torch.Tensor:
    """q * s - m per block of 32 inputs, q in 0..15, as a Q4_K tensor de-quantises; some blocks use
    only a few, non-adjacent levels. dyadic: s and m exact in few bits, so float32 sums are exact."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, inputs // 32, 32), generator=generator).float()
    codes[0, 0] = torch.tensor([3.0, 5.0, 11.0]).repeat(11)[:32]  # levels 3, 5, 11 only: gaps of 2 and 6
    codes[1, 0] = 7.0  # a block of one level
    codes[2, 0] = torch.tensor([0.0, 2.0, 7.0]).repeat(11)[:32]  # smallest gap 2 steps, yet step 1
    if dyadic:
        scale = torch.randint(1, 64, (rows, inputs // 32, 1), generator=generator).float() * 2**-12
        low = torch.randint(0, 512, (rows, inputs // 32, 1), generator=generator).float() * 2**-12
    else:  # many mantissa bits, as a Q4_K block's fp16 d times its 6-bit scale
        scale = torch.rand(rows, inputs // 32, 1, generator=generator) * 0.01 + 0.001
        low = torch.rand(rows, inputs // 32, 1, generator=generator) * 0.1
    return (codes * scale - low).view(rows, inputs)


@pytest.mark.parametrize("out_features", [128, 96, 48])  # 96, 48: padded to blocks of 64 channels
def test_a_weight_on_a_4_bit_grid_round_trips_bit_exactly_in_fp32(out_features):
    weight = on_grid(out_features, 64)
    linear = nn.Linear(64, out_features)
    linear.weight.data = weight.clone()
    grid = int4_grid(weight)
    assert grid is not None and int(grid.codes.min()) >= 0 and int(grid.codes.max()) <= 15
    layer = WeightOnlyLinear(linear, 4, grid=grid)
    assert torch.equal(layer.dequantized(torch.float32), weight)
    for rows in (1, KERNEL_ROWS[4] + 1):  # the kernel, then the de-quantised matmul
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), x @ weight.T + linear.bias, atol=1e-5, rtol=1e-5)


def test_a_grid_with_float32_rounding_is_recovered_to_within_that_rounding():
    weight = on_grid(64, 96, dyadic=False)
    grid = int4_grid(weight)
    assert grid is not None
    back = ((grid.codes.view(64, 3, 32) - 8) * grid.scale.T[..., None] + grid.zero.T[..., None]).view(64, 96)
    assert (back - weight).abs().max() < 1e-7


@pytest.mark.parametrize(
    "weight",
    [
        torch.randn(64, 64),  # a float weight
        on_grid(64, 64) * torch.linspace(1, 1.001, 64),  # a grid bent by a little
        torch.arange(64 * 64).float().view(64, 64) % 32 * 0.01,  # 32 levels in a block, as Q5_0 or Q8_0
        on_grid(64, 64)[:, :48],  # inputs not in groups of 32
    ],
)
def test_an_off_grid_weight_has_no_grid(weight):
    assert int4_grid(weight) is None


def saved_on_grid(folder):
    """A tiny model saved in float32 into `folder` with its attention projections on a 4-bit grid
    (the MLP and output layer not), returned in bf16: the cast takes the grid off the model's copy."""
    model = tiny_model("llama")
    state = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
    for name, tensor in state.items():
        if "self_attn" in name and name.endswith("weight"):
            state[name] = on_grid(*tensor.shape, seed=len(name), dyadic=False)
    model.load_state_dict(state)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, folder / "model.safetensors")
    return model.to(torch.bfloat16)


@pytest.fixture
def saved_model(tmp_path):
    return saved_on_grid(tmp_path), tmp_path


@pytest.mark.parametrize("fallback", ["int8", "none"])
def test_layers_off_the_grid_go_to_the_fallback(saved_model, fallback):
    model, folder = saved_model
    quantized = quantize_model(copy.deepcopy(model), "int4-exact", folder, fallback)
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        layer = quantized.get_submodule(name)
        if "self_attn" in name:
            assert isinstance(layer, WeightOnlyLinear) and layer.bits == 4, name
        elif fallback == "int8":
            assert isinstance(layer, WeightOnlyLinear) and layer.bits == 8, name
        else:
            assert type(layer) is nn.Linear and torch.equal(layer.weight, module.weight), name
    census = quantization_census(quantized)
    attention = sum(
        1 for name, m in model.named_modules() if "self_attn" in name and isinstance(m, nn.Linear)
    )
    assert census is not None and census["int4"]["layers"] == attention
    assert set(census) == {"int4", fallback}


def test_the_grid_is_read_from_the_float32_file_not_the_bf16_model(saved_model):
    model, folder = saved_model
    from_file = quantize_model(copy.deepcopy(model), "int4-exact", folder)
    from_model = quantize_model(copy.deepcopy(model), "int4-exact")
    assert quantization_census(from_file)["int4"]["layers"] > 0  # type: ignore[index]
    assert "int4" not in quantization_census(from_model)  # type: ignore[operator]
