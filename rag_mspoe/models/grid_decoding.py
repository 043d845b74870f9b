"""A layer that decodes on a GGUF file's own 4-bit codes and reads a prompt as before (`GridDecodingLinear`).

Decoding reads every weight once per token, so its time follows the bytes read. A layer stored in
Q4_K / Q4_1 is already 4-bit in the file (`rag_mspoe.models.int4_grid` recovers its codes, scales and
minimums), and torch's int4 CPU kernel reads those codes in 0.3x the bf16 matrix-vector product's
time at one token (the 1.5B's gate projection, one thread: 0.75 against 2.46 ms), and in about the
same at 11 (a drafted step's check). Its time grows with the tokens, though, so a prompt's many
tokens stay on the wrapped layer (the bf16 weight, or `Int8PromptLinear`'s int8 read).

The codes are the file's own: the kernel computes the weights the model was shipped with, up to
the rounding of each group's scale and zero to bf16, an error the size of bf16's own rounding of
the weights (relative output error 0.0031 against the bf16 layer's 0.0029, against the file's
float32 values). Every call of `PROMPT_TOKENS` tokens or fewer per sequence, a decoding step and a
drafted step's check alike, runs on the codes, so drafted answers equal greedy ones (in float32;
in bf16 the model's other layers round an 11-token check otherwise than one token, as without it).

The layer keeps the wrapped layer's weight for the prompt and adds the codes: half a byte per
weight, plus a scale and zero per 32.

"int8-decoding" and "int4-decoding" wrap the layer as it is (a prompt read on its own weights) with
decoding on int8 codes, or on the file's codes where it has them; their kernels compute in bf16
in a float32 model (`rag_mspoe.models.quantization`).
"""

from __future__ import annotations

import torch
from torch import nn

from rag_mspoe.models.int8_prompt import reads_prompt
from rag_mspoe.models.weight_only import WeightOnlyLinear


class GridDecodingLinear(nn.Module):
    """`prompt_layer` for a prompt's read, `decoding` (the layer on codes) for shorter calls."""

    def __init__(self, prompt_layer: nn.Module, decoding: WeightOnlyLinear) -> None:
        super().__init__()
        self.prompt_layer = prompt_layer
        self.decoding = decoding

    @property
    def in_features(self) -> int:
        return self.decoding.in_features

    @property
    def out_features(self) -> int:
        return self.decoding.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.prompt_layer(x) if reads_prompt(x) else self.decoding(x)
