"""Quantised CPU inference: weight-only int4/int8 (`quantize="int4"`, `"int8"`, `"int4-exact"`), an
int8 prompt read (`"int8-prompt"`), and that read with decoding on a GGUF file's own 4-bit codes
(`"int8-prompt+int4"`); `"auto"`, answering's default, picks per model.

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

"int8-prompt+int4" reads the prompt as "int8-prompt" does and decodes the layers a GGUF file stored
on a 4-bit grid (Q4_K / Q4_1) on the file's own codes (`rag_mspoe.models.grid_decoding`), the other
layers on the model's weights: for a Q4_K_M file such as the 1.5B's (72 % of its layers' weights on
the grid) a decoding step in 0.55x bf16's time.

"int8-prompt+int4-decoding" reads the prompt as "int8-prompt" does and decodes every layer but the
output layer on codes: the file's own 4-bit codes where it has them, int8 codes (one scale per
output channel) elsewhere, such as the 1.5B's Q6_K value and down projections. The output layer
stays on the model's weights: its int8 kernel reads one token in half bf16's time, but a drafted
step's check of five in more (the 1.5B's 151,936 x 1,536: 30 against 27 ms), and drafted decoding
was quicker with it in bf16 (0.140 against 0.153 s a token, docs/cpu-inference.md). The 1.5B's
gold answers moved 0.048 nats per token on 100 prompts (int8-prompt+int4: 0.046), so "auto" loads
it for the 1.5B.

"int8-decoding" and "int4-decoding" leave the prompt's read as it is (the model's own weights, in
its dtype) and decode on int8 codes (one scale per output channel), or on the file's own 4-bit
codes where its layers have them and int8 codes elsewhere, every Linear layer the output layer
included; their kernels compute in bf16 whatever the model's dtype. They are for a CPU without
native bf16, where the model computes in float32: there float32 reads a prompt 5x as fast as
emulated bf16, but decoding, which reads every weight once per token, reads 4 bytes a weight;
the kernels read 1 or half a byte.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn

from rag_mspoe.models.devices import resolve_dtype
from rag_mspoe.models.embedded_models import MODELS
from rag_mspoe.models.file_grids import FileGrids
from rag_mspoe.models.grid_decoding import GridDecodingLinear
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
# int8-prompt's read, and decoding on the file's 4-bit codes where its layers have them.
INT8_PROMPT_INT4 = "int8-prompt+int4"
# int8-prompt's read, and decoding on the file's 4-bit codes where its layers have them, int8 codes elsewhere.
INT8_PROMPT_INT4_DECODING = "int8-prompt+int4-decoding"
# What an int8-prompt layer off the grid becomes in it: decoding on int8 codes.
INT8_PROMPT_INT8 = "int8-prompt+int8"
# The prompt read on the model's own weights; decoding on int8 codes, or on the file's 4-bit codes
# where its layers have them (int8 elsewhere); what each layer becomes is named so too.
INT8_DECODING = "int8-decoding"
INT4_DECODING = "int4-decoding"
# The dtype the decoding schemes' kernels compute in (weight_only's docstring: their float32 forms
# are several times slower).
DECODING_KERNEL_DTYPE = torch.bfloat16
# "auto": what an embedded model was measured to answer best with on the CPU in bf16 or float32
# (`EmbeddedModel.answering_quantize`, `answering_quantize_float32`), none for any other model,
# device or dtype.
AUTO = "auto"
# What a model can take.
SCHEMES = (*_BITS, INT8_PROMPT, INT8_PROMPT_INT4, INT8_PROMPT_INT4_DECODING, INT8_DECODING, INT4_DECODING)
QUANTIZE_CHOICES = (AUTO, "none", *SCHEMES)
# What an int4-exact layer off the 4-bit grid becomes: int8 weight-only, or kept as it is.
FALLBACKS = ("int8", "none")
INT4_GROUP_SIZE = 32  # as GGUF's Q4_K / Q4_1 groups
# CPU capabilities (torch.backends.cpu.get_cpu_capability) whose torch._int_mm is a slow fallback.
_SLOW_INT_MM = ("DEFAULT", "AVX2")
# Schemes that read a prompt with torch._int_mm.
_INT8_PROMPT_READS = (INT8_PROMPT, INT8_PROMPT_INT4, INT8_PROMPT_INT4_DECODING)
# Schemes that read the file's 4-bit grids.
_ON_GRIDS = (EXACT, INT8_PROMPT_INT4, INT8_PROMPT_INT4_DECODING, INT4_DECODING)
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
    if embedded is None or device.type != "cpu":
        return None  # measured for the embedded models on the CPU only
    return {
        torch.bfloat16: embedded.answering_quantize,
        torch.float32: embedded.answering_quantize_float32,
    }.get(resolve_dtype(dtype, device))


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
    int4 only the layers on a 4-bit grid, the others `fallback` ("int8" or "none": unchanged);
    "int8-prompt+int4" finds the grids so too. A converted GGUF's grids are found once and saved
    beside it (`rag_mspoe.models.file_grids`).
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
    grids = FileGrids(source, INT4_GROUP_SIZE) if scheme in _ON_GRIDS else None
    replace = _layer_replacer(model, scheme, grids, fallback)
    census: dict[str, list[int]] = {}
    replaced: list[tuple[nn.Module, str, nn.Linear]] = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            layer, kind = replace(name, child)
            if layer is not None:
                setattr(parent, name, layer)
                replaced.append((parent, name, child))
            counts = census.setdefault(kind, [0, 0])
            counts[0] += 1
            counts[1] += child.weight.numel()
    try:
        _check_census(scheme, census.keys(), type(model).__name__)
    except QuantizationError:
        for parent, name, child in replaced:  # the model as it came
            setattr(parent, name, child)
        raise
    if grids is not None:
        grids.save()  # the next load reads them instead of finding them again
    if scheme in _INT8_PROMPT_READS and torch.backends.cpu.get_cpu_capability() in _SLOW_INT_MM:
        warnings.warn(
            f"quantize={scheme!r} reads prompts with torch._int_mm, which this CPU "
            f"({torch.backends.cpu.get_cpu_capability()}, no AVX-512) runs about 20x slower than the "
            "float32 matmul (a 1,300 x 896 x 4,864 product: 5.5 s against 0.26 s, one thread); use "
            "--quantize auto (int8-decoding / int4-decoding for the embedded models in float32).",
            stacklevel=2,
        )
    setattr(model, _ATTRIBUTE, scheme)
    setattr(model, _CENSUS, {kind: {"layers": n, "weights": w} for kind, (n, w) in census.items()})
    return model


def _check_census(scheme: str, kinds: Collection[str], model_type: str) -> None:
    """Refuse a scheme that found nothing to do in a model (what its layers became: `kinds`)."""
    if scheme in _INT8_PROMPT_READS and not {INT8_PROMPT, INT8_PROMPT_INT4, INT8_PROMPT_INT8} & set(kinds):
        raise QuantizationError(
            f"quantize={scheme!r} found no MLP layer named {' or '.join(INT8_PROMPT_LAYERS)} in this "
            f"{model_type}; it supports Llama-style models (Llama, Qwen2, Mistral, SmolLM2). "
            "Use --quantize int8 (weight-only, any model) or none."
        )
    fixes = {INT8_PROMPT_INT4: INT8_PROMPT, INT4_DECODING: INT8_DECODING}
    if scheme in fixes and not {INT8_PROMPT_INT4, INT4_DECODING} & set(kinds):
        raise QuantizationError(
            f"quantize={scheme!r} found no layer stored on a 4-bit grid in this model (a GGUF file's Q4_K "
            "or Q4_1 tensors, such as the embedded qwen2.5-coder-1.5b-instruct's), so it would decode "
            f"exactly as {fixes[scheme]!r}: use --quantize {fixes[scheme]}."
        )


def _layer_replacer(
    model: Any, scheme: str, grids: FileGrids | None, fallback: str
) -> Callable[[str, nn.Linear], tuple[nn.Module | None, str]]:
    """(a Linear layer's name, the layer) -> (its replacement or None to keep it, what it became)."""
    if scheme == INT8_PROMPT:
        return lambda name, linear: (
            (Int8PromptLinear(linear), INT8_PROMPT) if name in INT8_PROMPT_LAYERS else (None, "none")
        )
    if scheme == INT8_DECODING:
        return lambda _, linear: _decoding_layer(linear, None)
    if grids is None:
        return lambda _, linear: _weight_only_layer(linear, _BITS[scheme])
    names = _parameter_names(model)
    output_layer = model.get_output_embeddings()

    def replace(name: str, linear: nn.Linear) -> tuple[nn.Module | None, str]:
        if scheme == INT4_DECODING:
            on_codes = _on_file_grid(linear, grids, names[id(linear.weight)], DECODING_KERNEL_DTYPE)
            return _decoding_layer(linear, on_codes)
        if scheme == INT8_PROMPT_INT4_DECODING:
            on_codes = _on_file_grid(linear, grids, names[id(linear.weight)], DECODING_KERNEL_DTYPE)
            if on_codes is None and linear is not output_layer:
                on_codes = WeightOnlyLinear(linear, 8, dtype=DECODING_KERNEL_DTYPE)
            return _grid_decoding_layer(name, linear, on_codes)
        on_grid = _on_file_grid(linear, grids, names[id(linear.weight)])
        if scheme == INT8_PROMPT_INT4:
            return _grid_decoding_layer(name, linear, on_grid)
        return _exact_layer(linear, on_grid, fallback)

    return replace


def _weight_only_layer(linear: nn.Linear, bits: int) -> tuple[WeightOnlyLinear | None, str]:
    """int4's or int8's replacement of a layer (None where int4's groups of 32 do not fit) and its kind."""
    if bits == 8 or linear.in_features % INT4_GROUP_SIZE == 0:
        return WeightOnlyLinear(linear, bits, INT4_GROUP_SIZE), f"int{bits}"
    return None, "none"


def _grid_decoding_layer(
    name: str, linear: nn.Linear, decoding: WeightOnlyLinear | None
) -> tuple[nn.Module | None, str]:
    """int8-prompt+int4's and int8-prompt+int4-decoding's replacement of a layer (None to keep it)
    and what it became: a prompt read as int8-prompt reads it, shorter calls on `decoding`'s codes."""
    prompt_layer: nn.Module = Int8PromptLinear(linear) if name in INT8_PROMPT_LAYERS else linear
    if decoding is not None:
        kinds = {4: (INT8_PROMPT_INT4, INT4_DECODING), 8: (INT8_PROMPT_INT8, INT8_DECODING)}[decoding.bits]
        kind = kinds[0] if prompt_layer is not linear else kinds[1]  # the prompt read in int8, or not
        return GridDecodingLinear(prompt_layer, decoding), kind
    return (prompt_layer, INT8_PROMPT) if prompt_layer is not linear else (None, "none")


def _decoding_layer(linear: nn.Linear, on_grid: WeightOnlyLinear | None) -> tuple[nn.Module, str]:
    """int8-decoding's and int4-decoding's replacement of a layer, and what it became: the layer
    for a prompt, its codes on the file's grid (`on_grid`) or int8 codes for shorter calls."""
    if on_grid is not None:
        return GridDecodingLinear(linear, on_grid), INT4_DECODING
    return GridDecodingLinear(linear, WeightOnlyLinear(linear, 8, dtype=DECODING_KERNEL_DTYPE)), INT8_DECODING


def _exact_layer(
    linear: nn.Linear, on_grid: WeightOnlyLinear | None, fallback: str
) -> tuple[WeightOnlyLinear | None, str]:
    """int4-exact's replacement of a layer (None to keep it) and what it became: "int4", "int8" or "none"."""
    if on_grid is not None:
        return on_grid, "int4"
    if fallback == "int8":
        return WeightOnlyLinear(linear, 8), "int8"
    return None, "none"


def _on_file_grid(
    linear: nn.Linear, grids: FileGrids, names: list[str], dtype: torch.dtype | None = None
) -> WeightOnlyLinear | None:
    """The layer as int4 on the 4-bit grid its stored weight (else its own) lies on, or None if off
    it; its kernel computes in `dtype` (default: the layer's)."""
    grid = grids.grid(names, linear.weight.detach())
    return None if grid is None else WeightOnlyLinear(linear, 4, INT4_GROUP_SIZE, grid=grid, dtype=dtype)


def _parameter_names(model: Any) -> dict[int, list[str]]:
    """Every name of each parameter (a tied output layer also answers to the embeddings' name)."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return names


def quantization_census(model: Any) -> dict[str, dict[str, int]] | None:
    """Per kind a quantised model's Linear layers became ("int4", "int8", "none"): layers and weights."""
    return getattr(model, _CENSUS, None)


def quantization_of(model: Any) -> str | None:
    """The scheme `quantize_model` applied to the model, or None."""
    return getattr(model, _ATTRIBUTE, None)
