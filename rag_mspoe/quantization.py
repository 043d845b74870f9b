"""Opt-in int8 inference on the CPU: dynamic quantisation of the Linear layers.

`quantize_model(model, "int8")` replaces the attention projections and the MLP's gate and up
projections with torch's dynamically quantised Linear: weights stored in int8, one scale per
output channel; each call quantises its input to 8 bits on the fly (one scale for the whole
input), multiplies in integers and returns float32. Everything else (embeddings, norms,
attention, the MLP's down projection, the output layer) runs in float32. The RoPE and attention
methods hook rotary embeddings and attention modules, never a Linear layer's weights, so they
apply to the quantised model unchanged.

What it buys (`benchmarks/bench_cpu_inference.py`, Qwen2.5-Coder-0.5B, real 10-document
prompts, one thread, README "CPU inference: int8, threads, compiled decoding"): decoding 1.45x
as fast as bf16, prefill 0.72x (bf16 matmuls run on the CPU's native bf16 instructions, and
everything outside these layers runs in float32 here). So it helps generation, not scoring;
and since the scores move (below), sweeps should stay in bf16, which is why this is opt-in.

What stays in float32, and why (teacher-forced log-likelihood of 800-1,000 tokens of English
text, mean change per token against float32):
- the MLP's down projection: its input holds a few channels hundreds of times larger than the
  rest, and one 8-bit scale for them all wipes out the others. Quantising it too moved
  SmolLM2-135M by 1.37 nats per token and Qwen2.5-Coder-0.5B by 0.84; keeping it, 0.51 and 0.25
  (bf16 moves SmolLM2 by 0.04).
- the output layer: the scores are read from its logits, and it runs only where scored.
Weights get one scale per output channel, not per layer: with every block's Linear layer
quantised, 0.13 against 0.58 nats per token of gold answer on four real 10-document prompts.

torch's quantisation is used, not torchao's `Int8DynamicActivationInt8WeightConfig` (one scale
per token): measured side by side, torchao's moved the gold answers' log-likelihood less (0.045
against 0.24 nats per token) but was slower than bf16 at both prefill (262 against 399 tokens/s)
and decoding (6.7 against 10.0), so it offers nothing bf16 does not.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

QUANTIZE_CHOICES = ("int8",)
# Where `quantize_model` notes the scheme on the model, for run manifests.
_ATTRIBUTE = "_rag_mspoe_quantization"
# Module names (last part) left in float32, see the module docstring.
_KEPT_IN_FLOAT = ("lm_head", "down_proj")


class QuantizationError(ValueError):
    """A quantisation that cannot be done here; the message names the fix."""


def check_quantize(scheme: str | None, device: torch.device, dtype: torch.dtype | str | None = None) -> None:
    """Refuse, before any weights load, a scheme this device or dtype cannot run."""
    if scheme is None:
        return
    if scheme not in QUANTIZE_CHOICES:
        raise QuantizationError(
            f"quantize={scheme!r} is not supported; use one of: {', '.join(QUANTIZE_CHOICES)} (or none)."
        )
    if device.type != "cpu":
        raise QuantizationError(
            f"quantize={scheme!r} runs on the CPU only (torch's dynamic int8 kernels have no {device.type} "
            f"version), but the model would load on {device}. Pass --device cpu, or drop --quantize and "
            "use --dtype bfloat16 or float16 on the GPU."
        )
    named = str(dtype).strip().lower().removeprefix("torch.") if dtype is not None else "auto"
    if named not in ("auto", "float32", "fp32", "float"):
        raise QuantizationError(
            f"quantize={scheme!r} computes everything outside the Linear layers in float32, so it cannot "
            f"be combined with dtype {named}; drop --dtype (or pass float32)."
        )


def quantize_model(model: Any, scheme: str | None) -> Any:
    """The model with its Linear layers quantised in place (see the module docstring); None: unchanged."""
    if scheme is None:
        return model
    check_quantize(scheme, next(model.parameters()).device)
    model.float()  # the int8 kernels take and give float32
    spec = {
        name: torch.ao.quantization.per_channel_dynamic_qconfig
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rpartition(".")[2] not in _KEPT_IN_FLOAT
    }
    with warnings.catch_warnings():
        # torch.ao.quantization warns that it will move to torchao; its kernels are the fast ones here.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        torch.ao.quantization.quantize_dynamic(model, spec, dtype=torch.qint8, inplace=True)
    setattr(model, _ATTRIBUTE, scheme)
    return model


def quantization_of(model: Any) -> str | None:
    """The scheme `quantize_model` applied to the model, or None."""
    return getattr(model, _ATTRIBUTE, None)
