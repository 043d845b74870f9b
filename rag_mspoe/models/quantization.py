"""Quantised CPU inference: weight-only int4/int8 (`quantize="int4"`, `"int8"`, `"int4-exact"`) and an
int8 prompt read (`"int8-prompt"`); `"auto"`, answering's default, picks per model.

Every Linear layer, the output layer and the MLP's down projection included, becomes a
`rag_mspoe.models.weight_only.WeightOnlyLinear`: int4 weights in groups of 32 inputs (as GGUF's Q4_K and
Q4_1 groups) or int8 weights with one scale per output channel, decoded through torch's
weight-only CPU kernels; activations stay in the model's dtype. Prefill de-quantises one layer at
a time. The RoPE and attention methods hook rotary embeddings and attention modules, never a
Linear layer's weights, so they apply to the quantised model unchanged.

"int4-exact" makes int4 only the layers whose stored float32 weights lie on a 4-bit grid (a GGUF
file's Q4_K / Q4_1 tensors, `rag_mspoe.models.int4_grid`), with the file's own codes, scales and minimums,
and int8 (or, with fallback="none", the model's dtype) the layers stored in Q5_0, Q6_K or Q8_0.

Measured (docs/cpu-inference.md, Qwen2.5-Coder-0.5B, real 10-document prompts, one thread):
decoding 1.8-1.9x (int8) and 2.7-4.2x (int4) as fast as bf16, prefill about as fast, but the gold
answers' log-likelihood moved 0.056 (int8) and 0.45 (int4) nats per token on average over 20
prompts, above the 0.05 the project allows for a default: so no weight-only scheme is a default.
The earlier dynamic int8 (activations quantised too; attention and MLP gate/up projections only)
was removed: weight-only int8 beat it side by side in decoding (1.77x against 1.25x bf16),
prefill (86 against 45 tokens/s, bf16 94) and drift (0.056 against 0.30 nats per token).

"int8-prompt" is not weight-only: the MLP's gate and up projections read a prompt's many tokens
with int8 activations times int8 weights through `torch._int_mm`
(`rag_mspoe.models.int8_prompt.Int8PromptLinear`), and every other call, decoding included, runs
the model's own weights. Of the layer sets measured it moved the gold answer's log-likelihood
least for its speed: 0.049 / 0.047 nats per token on 100 prompts (Qwen2.5-Coder-0.5B / 1.5B), so
"auto" loads it for those two on a bf16 CPU (`EmbeddedModel.answering_quantize`; SmolLM2: 0.083).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rag_mspoe.models.devices import resolve_dtype
from rag_mspoe.models.embedded_models import MODELS
from rag_mspoe.models.int4_grid import int4_grid
from rag_mspoe.models.int8_prompt import Int8PromptLinear
from rag_mspoe.models.weight_only import WeightOnlyLinear

# Weight-only schemes and their bits; "int4-exact" is int4 where the file's weights lie on a 4-bit
# grid and `fallback` (int8 by default) elsewhere.
_BITS = {"int4": 4, "int8": 8, "int4-exact": 4}
EXACT = "int4-exact"
# int8 activations x int8 weights for a prompt's read, in these layers only (their names in
# Llama-style models: Llama, Qwen2, Mistral, SmolLM2).
INT8_PROMPT = "int8-prompt"
INT8_PROMPT_LAYERS = ("gate_proj", "up_proj")
# "auto": what an embedded model was measured to answer best with on a bf16 CPU
# (`EmbeddedModel.answering_quantize`), none for any other model, device or dtype.
AUTO = "auto"
SCHEMES = (*_BITS, INT8_PROMPT)  # what a model can be quantised with
QUANTIZE_CHOICES = (AUTO, "none", *SCHEMES)
# What an int4-exact layer off the 4-bit grid becomes: int8 weight-only, or kept as it is.
FALLBACKS = ("int8", "none")
INT4_GROUP_SIZE = 32  # as GGUF's Q4_K / Q4_1 groups
# Where `quantize_model` notes the scheme on the model, for run manifests, and what each layer became.
_ATTRIBUTE = "_rag_mspoe_quantization"
_CENSUS = "_rag_mspoe_quantization_census"
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
    """Refuse, before any weights load, a scheme this device or dtype cannot run ("auto": one that can)."""
    if scheme is None or scheme in ("none", AUTO):
        return
    if scheme not in QUANTIZE_CHOICES:
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


def answering_scheme(
    scheme: str | None, name: str, device: torch.device, dtype: torch.dtype | str | None
) -> str | None:
    """The scheme "auto" stands for with the model `name` on `device` in `dtype`; any other, itself."""
    if scheme != AUTO:
        return scheme
    embedded = MODELS.get(name)
    if embedded is None or device.type != "cpu" or resolve_dtype(dtype, device) != torch.bfloat16:
        return None  # measured for the embedded models in bf16 on the CPU only
    return embedded.answering_quantize


def quantize_model(
    model: Any,
    scheme: str | None,
    source: str | os.PathLike[str] | None = None,
    fallback: str = "int8",
) -> Any:
    """The model with its Linear layers quantised in place (module docstring); None or "none": unchanged.

    An int4 layer whose inputs do not split into groups of 32 stays as it is. "int4-exact" reads
    each weight from the safetensors files in the folder `source` (the converted GGUF's float32
    values, before the load cast them to bf16; without a file, the model's own weight) and makes
    int4 only the layers on a 4-bit grid, the others `fallback` ("int8" or "none": unchanged).
    """
    if scheme is None or scheme == "none":
        return model
    if scheme == AUTO:
        raise QuantizationError(
            'quantize="auto" depends on the model\'s name: load it with load_model or Engine.load, or '
            f"pass a scheme ({', '.join(SCHEMES)})."
        )
    check_quantize(scheme, next(model.parameters()).device, next(model.parameters()).dtype)
    if fallback not in FALLBACKS:
        raise QuantizationError(
            f"fallback={fallback!r} is not supported; use one of: {', '.join(FALLBACKS)}."
        )
    replace = _layer_replacer(model, scheme, source, fallback)
    census: dict[str, list[int]] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            layer, kind = replace(name, child)
            if layer is not None:
                setattr(parent, name, layer)
            counts = census.setdefault(kind, [0, 0])
            counts[0] += 1
            counts[1] += child.weight.numel()
    if scheme == INT8_PROMPT and INT8_PROMPT not in census:
        raise QuantizationError(
            f"quantize={INT8_PROMPT!r} found no MLP layer named {' or '.join(INT8_PROMPT_LAYERS)} in this "
            f"{type(model).__name__}; it supports Llama-style models (Llama, Qwen2, Mistral, SmolLM2). "
            "Use --quantize int8 (weight-only, any model) or none."
        )
    setattr(model, _ATTRIBUTE, scheme)
    setattr(model, _CENSUS, {kind: {"layers": n, "weights": w} for kind, (n, w) in census.items()})
    return model


def _layer_replacer(
    model: Any, scheme: str, source: str | os.PathLike[str] | None, fallback: str
) -> Callable[[str, nn.Linear], tuple[nn.Module | None, str]]:
    """(a Linear layer's name, the layer) -> (its replacement or None to keep it, what it became)."""
    if scheme == INT8_PROMPT:
        return lambda name, linear: (
            (Int8PromptLinear(linear), INT8_PROMPT) if name in INT8_PROMPT_LAYERS else (None, "none")
        )
    stored = _stored_weights(source) if scheme == EXACT else None
    names = _parameter_names(model)
    return lambda _, linear: _quantized_layer(linear, scheme, fallback, stored, names[id(linear.weight)])


def _quantized_layer(
    linear: nn.Linear,
    scheme: str,
    fallback: str,
    stored: Callable[[list[str]], torch.Tensor | None] | None,
    names: list[str],
) -> tuple[WeightOnlyLinear | None, str]:
    """(the layer's replacement or None to keep it, what it became: "int4", "int8" or "none")."""
    if stored is None:
        if _BITS[scheme] == 8 or linear.in_features % INT4_GROUP_SIZE == 0:
            return WeightOnlyLinear(linear, _BITS[scheme], INT4_GROUP_SIZE), scheme
        return None, "none"
    weight = stored(names)
    grid = int4_grid(linear.weight.detach() if weight is None else weight, INT4_GROUP_SIZE)
    if grid is not None:
        return WeightOnlyLinear(linear, 4, INT4_GROUP_SIZE, grid=grid), "int4"
    if fallback == "int8":
        return WeightOnlyLinear(linear, 8), "int8"
    return None, "none"


def _parameter_names(model: Any) -> dict[int, list[str]]:
    """Every name of each parameter (a tied output layer also answers to the embeddings' name)."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return names


def _stored_weights(source: str | os.PathLike[str] | None) -> Callable[[list[str]], torch.Tensor | None]:
    """A reader of the first of some tensor names stored in the folder's safetensors files, or None."""
    from safetensors import safe_open

    folder = Path(source) if source is not None else None
    files: dict[str, Path] = {}
    if folder is not None and (folder / "model.safetensors.index.json").is_file():
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        files = {name: folder / file for name, file in index.items()}
    elif folder is not None and (folder / "model.safetensors").is_file():
        with safe_open(folder / "model.safetensors", "pt") as handle:
            files = dict.fromkeys(handle.keys(), folder / "model.safetensors")

    def read(names: list[str]) -> torch.Tensor | None:
        for name in names:
            if name in files:
                with safe_open(files[name], "pt") as handle:
                    return handle.get_tensor(name)
        return None

    return read


def quantization_census(model: Any) -> dict[str, dict[str, int]] | None:
    """Per kind a quantised model's Linear layers became ("int4", "int8", "none"): layers and weights."""
    return getattr(model, _CENSUS, None)


def quantization_of(model: Any) -> str | None:
    """The scheme `quantize_model` applied to the model, or None."""
    return getattr(model, _ATTRIBUTE, None)
