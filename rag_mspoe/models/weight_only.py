"""A Linear layer with int4 or int8 weights for CPU decoding (`WeightOnlyLinear`).

Decoding reads every weight once per token, so its speed follows the bytes read: torch's
weight-only CPU kernels read 4- or 8-bit weights and multiply them with the input in its own
dtype (no activation quantisation). They run a matrix-vector
loop per row, though: fast for a few rows, 17-19x slower than the bf16 matmul for a 1,300-row
prefill (one thread, 1300 x 896 x 4864: bf16 10 ms, int8 177 ms, int4 196 ms). So a call with
more than `kernel_rows` rows runs the plain matmul on de-quantised weights instead, with no memory
beyond one layer's weight at a time (keeping a bf16 copy for prefill would cost more memory than
the bf16 model itself). int8 only converts its codes (its per-channel scale multiplies the
output): about 0.05x a 1,300-row matmul. int4 builds the scaled weight, about 0.7-0.9x such a
matmul; fused or compiled forms of that were no faster here (docs/cpu-inference.md).

- int8: symmetric, one scale per output channel: w = q * scale, q in [-128, 127].
- int4: asymmetric, one scale and one offset per group of `group_size` inputs of a row:
  w = (q - 8) * scale + zero, q in [0, 15] (the kernel's convention). A group's scale and
  offset come from its minimum and maximum, so a row of a GGUF Q4_K/Q4_1 file (4-bit codes with
  a scale and a minimum per group of 32) that uses its full code range comes back on the file's
  own grid.
- int4 from a grid (`grid=`, `rag_mspoe.models.int4_grid`): the codes, scales and zeros a GGUF Q4_K/Q4_1
  weight was stored with, read off its de-quantised float32 values, so the layer computes the
  file's own weights (up to the rounding of scale and zero to the layer's dtype).
Scales are kept in the dtype the kernels compute in (`dtype`; by default the layer's), as they
take them. A float32 model's decoding layers compute in bf16 (`dtype=torch.bfloat16`): the kernels'
float32 forms are 5-13x slower than their bf16 ones on a CPU without native bf16 (one thread, AVX2,
a 4864 x 896 layer at one row: int8 7.0 against 1.4 ms, int4 10.9 against 0.85 ms), so the input
is rounded to bf16 on the way in and the output comes back in float32.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional

from rag_mspoe.models.int4_grid import Int4Grid

BITS = (4, 8)
# The int4 kernel packs output channels in blocks of at most this many (`_int4_pack_block`); rows are
# padded up to it.
_INT4_BLOCK = 64
# Rows up to which a call uses the kernel, from one-thread timings on a 4864 x 896 layer: the
# kernels cost ~0.1 ms a row, de-quantising ~1.7 ms (int8) or ~8-15 ms (int4) plus the matmul.
KERNEL_ROWS = {8: 16, 4: 64}
# Rows quantised at a time (a multiple of 64): bounds the float32 temporaries of a large output
# layer, so quantising at load adds little to the load's peak memory.
_CHUNK_ROWS = 4096


class WeightOnlyLinear(nn.Module):
    """`linear` with its weight in `bits` (4 or 8) bits; see the module docstring."""

    packed: torch.Tensor
    scales: torch.Tensor

    def __init__(
        self,
        linear: nn.Linear,
        bits: int,
        group_size: int = 32,
        grid: Int4Grid | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {bits}")
        if grid is not None and bits != 4:
            raise ValueError(f"a 4-bit grid makes an int4 layer, not int{bits}")
        if bits == 4 and linear.in_features % group_size:
            raise ValueError(
                f"int4 groups of {group_size} need in_features divisible by it; got {linear.in_features}"
            )
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bits, self.group_size = bits, group_size
        self.kernel_rows = KERNEL_ROWS[bits]
        weight = linear.weight.detach()
        dtype = dtype or weight.dtype
        if grid is not None:
            packed, scales = _int4_from_grid(grid, dtype)
        elif bits == 8:
            packed, scales = int8_per_channel(weight, dtype)
        else:
            packed, scales = _int4(weight.to(dtype), group_size)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.bits == 4 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}{group}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > self.kernel_rows:
            if self.bits == 8:
                # One scale per output channel comes out of the product: the codes only change dtype
                # (about 10x cheaper than building the scaled weight), the scales multiply the output.
                out = functional.linear(x, self.packed.to(x.dtype)) * self.scales.to(x.dtype)
            else:
                # x @ W.T, W.T built contiguous: int4's layout unpacks to it with no element-wise transpose.
                out = torch.matmul(x, self._dequantized_t(x.dtype))
            return out if self.bias is None else out + self.bias
        flat = rows.to(self.scales.dtype).contiguous()
        if self.bits == 8:
            out = torch.ops.aten._weight_int8pack_mm(flat, self.packed, self.scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales)
            out = out[:, : self.out_features]
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight the layer computes with, [out_features, in_features], in `dtype` (default: scales')."""
        return self._dequantized_t(dtype or self.scales.dtype).T

    def _dequantized_t(self, dtype: torch.dtype) -> torch.Tensor:
        """The transposed weight, [in_features, out_features], contiguous."""
        if self.bits == 8:
            return (self.packed.to(dtype) * self.scales.to(dtype)[:, None]).T.contiguous()
        k, g = self.in_features, self.group_size
        codes = _unpacked_t(self.packed, k, _int4_pack_block()).to(dtype).reshape(k // g, g, -1)
        scale, zero = self.scales[..., 0].to(dtype).unsqueeze(1), self.scales[..., 1].to(dtype).unsqueeze(1)
        weight = torch.addcmul(zero - 8 * scale, codes, scale).view(k, -1)
        return weight[:, : self.out_features]


def int8_per_channel(
    weight: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [N, K], scales [N] in `dtype`, default the weight's), one symmetric scale per row
    (output channel); the codes are rounded against the scales as stored."""
    parts = [_int8_rows(rows, dtype or weight.dtype) for rows in weight.split(_CHUNK_ROWS)]
    return torch.cat([codes for codes, _ in parts]), torch.cat([scales for _, scales in parts])


def _int8_rows(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # One float32 copy, divided in place (a copy even of a float32 weight: the layer keeps it).
    values = weight.to(torch.float32, copy=True)
    scales = (values.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(dtype)
    codes = values.div_(scales.float()[:, None]).round_().clamp_(-128, 127).to(torch.int8)
    return codes, scales


def _int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's packed codes, [K / group, N_padded, 2] scale and zero in the weight's dtype)."""
    padded = functional.pad(weight, (0, 0, 0, -weight.shape[0] % _INT4_BLOCK))
    # Blocks of 64 rows pack independently, so chunks of rows concatenate into the whole layer's.
    parts = [_int4_rows(rows, group_size) for rows in padded.split(_CHUNK_ROWS)]
    return torch.cat([packed for packed, _ in parts]), torch.cat([scales for _, scales in parts], 1)


def _int4_from_grid(grid: Int4Grid, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's packed codes and scales for codes already on a grid (`rag_mspoe.models.int4_grid`)."""
    pad = -grid.codes.shape[0] % _INT4_BLOCK
    # Padding copies the whole int32 grid even by no rows, which once took a sixth of the load.
    codes = functional.pad(grid.codes, (0, 0, 0, pad)) if pad else grid.codes
    packed = torch.cat([_pack_int4(rows) for rows in codes.split(_CHUNK_ROWS)])
    scales = torch.stack([grid.scale, grid.zero], -1)
    return packed, (functional.pad(scales, (0, 0, 0, pad)) if pad else scales).to(dtype)


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)


def _unpacked_t(packed: torch.Tensor, k: int, block: int) -> torch.Tensor:
    """The codes [K, N] (N padded) that `_pack_int4` packed, for the kernel's layout with `block`
    channels a block: per block and per input, byte j holds channel j in its low nibble and
    channel j + block / 2 in its high one; so moving whole blocks gives W.T."""
    blocks = packed.view(-1, k, block // 2)
    return torch.cat([blocks & 15, blocks >> 4], -1).transpose(0, 1).reshape(k, -1)


@functools.cache
def _int4_pack_block() -> int:
    """Channels per block of torch's int4 packing on this CPU: its kernel packs 64 with AVX-512 and
    32 with AVX2 (found by packing a probe, so a CPU of either kind reads its own layout)."""
    channels = torch.arange(_INT4_BLOCK, dtype=torch.int32)
    probe = torch.stack([channels % 16, channels // 16], 1)  # [N, K = 2]: each channel its own pair
    packed = _pack_int4(probe)
    for block in (_INT4_BLOCK, _INT4_BLOCK // 2):
        if torch.equal(_unpacked_t(packed, 2, block).T.to(torch.int32), probe):
            return block
    raise RuntimeError(
        f"torch {torch.__version__}'s int4 packing on this CPU ({torch.backends.cpu.get_cpu_capability()}) "
        "has a layout this version cannot read back for a prompt; use --quantize int8 or int8-decoding."
    )


def _int4_rows(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = weight.shape
    groups = weight.float().view(n, k // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    # Round scale and zero to the stored dtype first, so the codes fit the grid the kernel uses.
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny).to(weight.dtype).float()
    zero = (low + 8 * scale).to(weight.dtype).float()
    codes = torch.round((groups - (zero - 8 * scale)[..., None]) / scale[..., None]).clamp(0, 15)
    packed = _pack_int4(codes.view(n, k).to(torch.int32))
    return packed, torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(weight.dtype)
