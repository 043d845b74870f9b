"""Load a causal LM and its tokenizer: an embedded model by name, a local folder, a hub id or a GGUF file.

A GGUF file is converted once into the cache (`model_cache`) and loaded from there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from rag_mspoe.models import embedded_models
from rag_mspoe.models.devices import place, resolve_device
from rag_mspoe.models.model_cache import ModelLoadError, convert_gguf
from rag_mspoe.models.quantization import answering_scheme, quantize_model, resolve_quantize
from rag_mspoe.models.step_attention import use_step_attention


def source_name(source: str | os.PathLike[str] | None) -> str:
    """The name `load_model(source)` gives the model, known before loading it."""
    if source is None:
        return embedded_models.DEFAULT_MODEL
    if isinstance(source, str) and source in embedded_models.MODELS:
        return source
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        return path.stem
    return path.name if path.is_dir() else str(source)


def resolve_source(source: str | os.PathLike[str] | None) -> tuple[str, str]:
    """(folder or hub id to load from, display name) for a user-given model source.

    The name of an embedded model wins over a folder of the same name (write ./name for that).
    """
    if source is None:
        source = embedded_models.DEFAULT_MODEL
    if isinstance(source, str) and source in embedded_models.MODELS:
        return str(embedded_models.prepare(source)), source
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist; check the path.")
        return str(convert_gguf(path)), path.stem
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{path} is a folder but has no config.json; "
                "point at a Hugging Face model folder or a .gguf file."
            )
        return str(path), path.name
    if path.exists():
        raise ModelLoadError(f"{path} is neither a model folder nor a .gguf file.")
    return str(source), str(source)  # a hub id


def model_display_name(model: Any) -> str:
    """The short name `load_model` gave the model (the folder or hub id otherwise)."""
    return str(getattr(model, "_rag_mspoe_name", None) or model.config.name_or_path)


def default_threads() -> int:
    """The CPUs this process may use that other processes leave free, at least one.

    Free means not counted in the 1-minute load average. Measured on a 2-CPU machine
    (`benchmarks/bench_cpu_inference.py`): on idle CPUs, 2 threads prefill and decode faster than
    1; when another process keeps a CPU busy, oversubscribed threads cost far more than the idle
    core brings (1k-token prefill of the embedded model: 1.6 s on 1 thread, 5-12 s on 2).
    """
    cpus = len(os.sched_getaffinity(0))
    return max(1, min(cpus, cpus - round(os.getloadavg()[0])))


def set_threads(threads: int | None) -> None:
    """Set torch's intra-op thread count (default: `default_threads()`)."""
    threads = default_threads() if threads is None else threads
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    torch.set_num_threads(threads)


def load_model(
    source: str | os.PathLike[str] | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = "auto",
    threads: int | None = None,
    attn_implementation: str | None = None,
    quantize: str | None = None,
    **from_pretrained_kwargs: Any,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, ready for `rescale`.

    source: None for the embedded SmolLM2-135M-Instruct, the name of an embedded model
    (`rag-mspoe models`: "qwen2.5-coder-0.5b-instruct", ...), a local Hugging Face folder, a
    .gguf file, or a hub id (needs hub access). device: "auto" (the GPU when there is one,
    else the CPU), "cpu", "cuda" or "cuda:N"; a model too large for one GPU is spread over all
    of them. dtype: None or "auto" for bf16 on GPUs that compute it (else fp16) and on CPUs
    with native bf16 (else fp32), or a name ("bfloat16", "float16", "float32"). A device that
    is not there, a dtype it cannot compute or weights larger than its free memory raise
    `DeviceError` before any weights load. threads sets torch's CPU thread count (default:
    the CPUs the load average shows free, `default_threads`). quantize: None or "none", "int4",
    "int8" or "int4-exact" (weight-only: faster decoding on the CPU, but scores move; int4-exact
    reads the folder's float32 weights for the file's own 4-bit grid), "int8-prompt" (a quicker
    prompt read in the MLP's gate and up projections), "int8-prompt+int4" (that read, and decoding on
    the file's own 4-bit codes where it has them), "int8-prompt+int4-decoding" (and on int8 codes for
    the other layers but the output layer), "int8-decoding" / "int4-decoding" (the prompt on
    the model's own weights, decoding on int8 codes / on the file's 4-bit codes where it has them:
    for float32 on a CPU without native bf16) or "auto" (an embedded model's measured answering
    scheme on the CPU in bf16 or float32, `Engine.load`'s default); see
    `rag_mspoe.models.quantization` and docs/cpu-inference.md. attn_implementation: None attends
    as transformers chooses, with decoding steps on the CPU in float32 products instead of SDPA's
    kernel and, on a quantised path measured within the drift bound, bf16 prompts in blocks of
    query rows (`rag_mspoe.models.step_attention`); a name ("sdpa", "eager") is used throughout.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target = resolve_device(device)
    quantize = resolve_quantize(quantize, target, dtype)
    if target.type == "cpu" or threads is not None:
        set_threads(threads)
    folder, name = resolve_source(source)
    try:
        placement = place(AutoConfig.from_pretrained(folder), device, dtype)
        quantize = answering_scheme(quantize, name, target, placement.dtype)
        kwargs: dict[str, Any] = {"dtype": placement.dtype, **from_pretrained_kwargs}
        if placement.device_map:
            kwargs["device_map"] = placement.device_map
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model: Any = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    except OSError as exc:
        raise ModelLoadError(
            f"Could not load model {source!r}: {exc}. Without hub access, pass a local folder, a .gguf "
            f"file or the name of an embedded model ({', '.join(embedded_models.MODELS)})."
        ) from exc
    if not placement.device_map:
        model.to(placement.device)
    model.eval()
    if not attn_implementation:  # one named is kept as it is ("sdpa": torch's kernel throughout)
        # Blocks round a bf16 prompt's attention a little differently from SDPA's kernel: they are
        # part of a measured quantised path; the unquantised model (sweeps whose numbers are
        # published) reads its prompts as stock transformers does.
        blocks = quantize not in (None, "none") and embedded_models.prompt_blocks(name)
        use_step_attention(model, prompt_blocks=blocks)
    quantize_model(model, quantize, folder)
    model._rag_mspoe_name = name
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer
