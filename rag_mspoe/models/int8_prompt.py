"""A Linear layer that reads a prompt with int8 activations times int8 weights (`Int8PromptLinear`).

A RAG answer's time is mostly its prompt's read: large matrix products that bf16 already runs
near this CPU's bf16 peak. `torch._int_mm` multiplies int8 matrices in 0.45-0.47x that time
(docs/cpu-inference.md). For a call reading more than `PROMPT_TOKENS` tokens per sequence, each
input row is quantised to int8 on its own step (its largest magnitude at 127), multiplied with
the int8 weight (one symmetric scale per output channel, as `quantize="int8"`'s) and the int32
product scaled back in the model's dtype. A call with fewer tokens (a decoding step, a drafted
step's check, a short suffix) runs the layer's own weight, so an answer's tokens are decoded
exactly as without it and drafted answers equal greedy ones. Rows are quantised one by one, so a
prompt read in pieces (a kept prefix, then the rest) gives the rows it gives read whole.

The layer keeps its weight and adds the int8 codes (one byte per weight).
"""

from __future__ import annotations

import torch
from torch import nn

from rag_mspoe.models.weight_only import int8_per_channel

# Tokens per sequence above which a call reads int8; a drafted step checks
# `rag_mspoe.engine.engine_base.PROMPT_LOOKUP_TOKENS` + 1 = 11 and must stay on the weight (a test).
PROMPT_TOKENS = 16


class Int8PromptLinear(nn.Module):
    """`linear`, with a prompt's many tokens multiplied in int8 (module docstring)."""

    codes_t: torch.Tensor
    scales: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear
        codes, scales = int8_per_channel(linear.weight.detach())
        self.register_buffer("codes_t", codes.t())  # [in, out], as torch._int_mm takes it
        self.register_buffer("scales", scales)

    @property
    def in_features(self) -> int:
        return self.linear.in_features

    @property
    def out_features(self) -> int:
        return self.linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not reads_prompt(x):
            return self.linear(x)
        out = w8a8(x.reshape(-1, self.in_features), self.codes_t, self.scales)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.linear.bias is None else out + self.linear.bias


def reads_prompt(x: torch.Tensor) -> bool:
    """Whether a layer's input [..., tokens, features] reads more than `PROMPT_TOKENS` tokens per sequence."""
    return x.dim() >= 2 and x.shape[-2] > PROMPT_TOKENS


def w8a8(rows: torch.Tensor, codes_t: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """rows @ W.T for W = codes_t.T * scales[:, None], each row quantised to int8; in the rows' dtype."""
    quantized, row_scale = quantize_rows(rows)
    return scale_back(torch._int_mm(quantized, codes_t), row_scale, scales, rows.dtype)


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes, float32 step per row): each row symmetric, its largest magnitude at 127."""
    values = rows.float()  # converted once: the prompt's rows are the hot path
    row_scale = values.abs().amax(1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127
    return torch.round(values / row_scale).to(torch.int8), row_scale


def scale_back(
    product: torch.Tensor, row_scale: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The int32 product times each row's step and each output channel's scale, in `dtype`."""
    # In bf16 this rounds the product once more, as a bf16 matmul's output is rounded; in float32
    # the same scaling took 10x as long as these two bf16 passes.
    return product.to(dtype).mul_(row_scale.to(dtype)).mul_(scales.to(dtype))
