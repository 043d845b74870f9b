"""Opt-in quantised inference on the CPU: weight-only int4/int8, or dynamic int8.

- "int4" and "int8" (weight-only, `rag_mspoe.weight_only`): every Linear layer, the output layer
  and the MLP's down projection included, holds int4 (groups of 32) or int8 (one scale per output
  channel) weights and decodes through torch's weight-only kernels; activations stay in the
  model's dtype, so the scores move little. Prefill de-quantises one layer at a time. Measured
  speed, memory and drift: docs/cpu-inference.md.
- "int8-dynamic": the earlier scheme, below. It quantises the activations too.

Dynamic int8 replaces the attention projections and the MLP's gate and up
projections with torch's dynamically quantised Linear: weights stored in int8, one scale per
output channel; each call quantises its input to 8 bits on the fly (one scale for the whole
input) and multiplies in integers. Everything else (embeddings, norms, attention, the MLP's
down projection, the output layer) keeps the model's dtype: bf16 by default on CPUs that compute
it natively, where a bf16 matmul runs at about half the speed of the int8 one (one thread,
1,300 x 896 x 4,864: int8 877 GFLOP/s, bf16 486, fp32 117). The int8 kernels take and give
float32, so each quantised layer converts at its edges. The RoPE and attention methods hook
rotary embeddings and attention modules, never a Linear layer's weights, so they apply to the
quantised model unchanged.

What it buys (`benchmarks/bench_cpu_inference.py`, Qwen2.5-Coder-0.5B, real 10-document
prompts, one thread; README "CPU inference: int8, threads, compiled decoding"): prefill 1.15x
and decoding 1.17x as fast as bf16, short of the 1.8x of the quantised matmuls, since the rest
of the model is not quantised. With the unquantised layers in float32 instead, prefill ran at
0.72x bf16. The scores move (below) far more than bf16 moves them, so sweeps should stay in
bf16: this is opt-in.

What stays unquantised, and why (teacher-forced log-likelihood of 800-1,000 tokens of English
text, mean change per token against float32):
- the MLP's down projection: its input holds a few channels hundreds of times larger than the
  rest, and one 8-bit scale for them all wipes out the others. Quantising it too moved
  SmolLM2-135M by 1.37 nats per token and Qwen2.5-Coder-0.5B by 0.84 (0.80 with the rest in
  bf16); keeping it, 0.51 and 0.25 (0.24). bf16 alone moves the 0.5B by 0.03.
- the output layer: the scores are read from its logits, and it runs only where scored.
Weights get one scale per output channel, not per layer: with every block's Linear layer
quantised, 0.13 against 0.58 nats per token of gold answer on four real 10-document prompts.

torch's quantisation is used, not torchao's `Int8DynamicActivationInt8WeightConfig` (one scale
per token): measured side by side, torchao's moved the gold answers' log-likelihood less (0.045
against 0.22 nats per token) but was slower than bf16 at both prefill (262 against 402 tokens/s)
and decoding (7.0 against 9.7), so it offers nothing bf16 does not.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import nn

from rag_mspoe.weight_only import WeightOnlyLinear

SCHEMES = ("int4", "int8", "int8-dynamic")
# No scheme kept the gold answers' log-likelihood within 0.05 nats per token of bf16 on real
# 10-document prompts (docs/cpu-inference.md), so none is the default everywhere.
QUANTIZE_CHOICES = ("none", *SCHEMES)
# Weight-only schemes and their bits (`rag_mspoe.weight_only`).
_WEIGHT_ONLY_BITS = {"int4": 4, "int8": 8}
INT4_GROUP_SIZE = 32  # as GGUF's Q4_K / Q4_1 groups
# Where `quantize_model` notes the scheme on the model, for run manifests.
_ATTRIBUTE = "_rag_mspoe_quantization"
# Module names (last part) dynamic int8 leaves unquantised, see the module docstring.
_UNQUANTISED = ("lm_head", "down_proj")
# The dtypes the rest of a quantised model may compute in.
_REST_DTYPES = ("auto", "bfloat16", "bf16", "float32", "fp32", "float")


class QuantizationError(ValueError):
    """A quantisation that cannot be done here; the message names the fix."""


def resolve_quantize(
    scheme: str | None, device: torch.device, dtype: torch.dtype | str | None = None
) -> str | None:
    """The scheme to apply ("none": None); one this device or dtype cannot run is refused."""
    scheme = None if scheme == "none" else scheme
    check_quantize(scheme, device, dtype)
    return scheme


def check_quantize(scheme: str | None, device: torch.device, dtype: torch.dtype | str | None = None) -> None:
    """Refuse, before any weights load, a scheme this device or dtype cannot run."""
    if scheme is None or scheme == "none":
        return
    if scheme not in SCHEMES:
        raise QuantizationError(
            f"quantize={scheme!r} is not supported; use one of: {', '.join(QUANTIZE_CHOICES)}."
        )
    if device.type != "cpu":
        raise QuantizationError(
            f"quantize={scheme!r} runs on the CPU only (the {scheme} kernels used here have no "
            f"{device.type} version), but the model would load on {device}. Pass --device cpu, or drop "
            "--quantize and use --dtype bfloat16 or float16 on the GPU."
        )
    named = str(dtype).strip().lower().removeprefix("torch.") if dtype is not None else "auto"
    if named not in _REST_DTYPES:
        raise QuantizationError(
            f"quantize={scheme!r} runs the layers it does not quantise in bfloat16 or float32, not "
            f"{named}; drop --dtype (bf16 where the CPU computes it natively) or pass one of those."
        )


class Int8Linear(nn.Module):
    """torch's dynamically quantised Linear inside a model of another dtype."""

    def __init__(self, quantized: nn.Module) -> None:
        super().__init__()
        self.quantized = quantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantized(x.float()).to(x.dtype)  # the int8 kernels take and give float32


def quantize_model(model: Any, scheme: str | None) -> Any:
    """The model with its Linear layers quantised in place (module docstring); None or "none": unchanged."""
    if scheme is None or scheme == "none":
        return model
    check_quantize(scheme, next(model.parameters()).device, next(model.parameters()).dtype)
    bits = _WEIGHT_ONLY_BITS.get(scheme)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            if bits is not None and (bits == 8 or child.in_features % INT4_GROUP_SIZE == 0):
                setattr(parent, name, WeightOnlyLinear(child, bits, INT4_GROUP_SIZE))
            elif bits is None and name not in _UNQUANTISED:
                setattr(parent, name, Int8Linear(_quantized(child)))
    setattr(model, _ATTRIBUTE, scheme)
    return model


def _quantized(linear: nn.Linear) -> nn.Module:
    """torch's dynamic int8 Linear of a float32 copy of `linear`."""
    with warnings.catch_warnings():
        # torch.ao.quantization warns that it will move to torchao; its kernels are the fast ones here.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        wrapped = nn.Sequential(copy.deepcopy(linear).float())
        qconfig = {nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}
        return torch.ao.quantization.quantize_dynamic(wrapped, qconfig, dtype=torch.qint8)[0]


def quantization_of(model: Any) -> str | None:
    """The scheme `quantize_model` applied to the model, or None."""
    return getattr(model, _ATTRIBUTE, None)
