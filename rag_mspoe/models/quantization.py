"""Opt-in weight-only int4/int8 inference on the CPU (`quantize="int4"` or `"int8"`).

Every Linear layer, the output layer and the MLP's down projection included, becomes a
`rag_mspoe.models.weight_only.WeightOnlyLinear`: int4 weights in groups of 32 inputs (as GGUF's Q4_K and
Q4_1 groups) or int8 weights with one scale per output channel, decoded through torch's
weight-only CPU kernels; activations stay in the model's dtype. Prefill de-quantises one layer at
a time. The RoPE and attention methods hook rotary embeddings and attention modules, never a
Linear layer's weights, so they apply to the quantised model unchanged.

Measured (docs/cpu-inference.md, Qwen2.5-Coder-0.5B, real 10-document prompts, one thread):
decoding 1.8-1.9x (int8) and 2.7-4.2x (int4) as fast as bf16, prefill about as fast, but the gold
answers' log-likelihood moved 0.056 (int8) and 0.45 (int4) nats per token on average over 20
prompts, above the 0.05 the project allows for a default: so no quantisation is the default.
The earlier dynamic int8 (activations quantised too; attention and MLP gate/up projections only)
was removed: weight-only int8 beat it side by side in decoding (1.77x against 1.25x bf16),
prefill (86 against 45 tokens/s, bf16 94) and drift (0.056 against 0.30 nats per token).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rag_mspoe.models.weight_only import WeightOnlyLinear

# Weight-only schemes and their bits.
_BITS = {"int4": 4, "int8": 8}
QUANTIZE_CHOICES = ("none", *_BITS)
INT4_GROUP_SIZE = 32  # as GGUF's Q4_K / Q4_1 groups
# Where `quantize_model` notes the scheme on the model, for run manifests.
_ATTRIBUTE = "_rag_mspoe_quantization"
# The dtypes the kernels take (and the rest of a quantised model computes in).
_DTYPES = ("auto", "bfloat16", "bf16", "float32", "fp32", "float")


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
    if scheme not in _BITS:
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
    if named not in _DTYPES:
        raise QuantizationError(
            f"quantize={scheme!r} runs in bfloat16 or float32, not "
            f"{named}; drop --dtype (bf16 where the CPU computes it natively) or pass one of those."
        )


def quantize_model(model: Any, scheme: str | None) -> Any:
    """The model with its Linear layers quantised in place (module docstring); None or "none": unchanged.

    An int4 layer whose inputs do not split into groups of 32 stays as it is.
    """
    if scheme is None or scheme == "none":
        return model
    check_quantize(scheme, next(model.parameters()).device, next(model.parameters()).dtype)
    bits = _BITS[scheme]
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and (bits == 8 or child.in_features % INT4_GROUP_SIZE == 0):
                setattr(parent, name, WeightOnlyLinear(child, bits, INT4_GROUP_SIZE))
    setattr(model, _ATTRIBUTE, scheme)
    return model


def quantization_of(model: Any) -> str | None:
    """The scheme `quantize_model` applied to the model, or None."""
    return getattr(model, _ATTRIBUTE, None)
