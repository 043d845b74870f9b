"""Where a model runs and in which dtype: resolved and checked before any weights load.

`device` is "auto" (the GPU when there is one, else the CPU), "cpu", "cuda" or "cuda:N".
`dtype` is None or "auto" (bf16 on GPUs that compute it, fp16 on older ones; on CPUs bf16
where it is native, else fp32), or a name such as "bfloat16", "float16", "float32".
Every mistake (no GPU, a GPU index that is not there, bf16 on a GPU without it, a model
larger than the memory) raises `DeviceError`, whose message says what to do instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPE_NAMES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
# Weights are not all a forward needs: activations, the KV cache and the CUDA context take a
# share too. A model whose weights take more than this fraction of the free memory is refused.
WEIGHTS_SHARE_OF_FREE = 0.9
GIB = 1024**3

# Measured on a 2-CPU machine with native bf16, 1k-token prefill of the embedded model on one
# thread: bf16 1.6 s, fp32 4.0 s. Machines without native bf16 fall back to fp32, faster there.
_CPU_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class DeviceError(ValueError):
    """A device or dtype that cannot be used here; the message names the fix."""


@dataclass(frozen=True)
class Placement:
    """Where `load_model` puts a model: one device, or spread over every GPU (device_map="auto")."""

    device: torch.device
    dtype: torch.dtype
    device_map: str | None = None  # "auto" when the weights need more than one GPU


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """The torch device for a user's choice; refuses devices this machine does not have."""
    text = "auto" if device is None else str(device).strip().lower()
    if text == "auto":
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or text.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise DeviceError(
                f"device {text!r} asks for a GPU, but this torch ({torch.__version__}) sees no CUDA device"
                f"{' (it is a CPU-only build)' if torch.version.cuda is None else ''}. "
                "Use --device cpu (or auto), or install a CUDA build of torch on a machine with an "
                "NVIDIA GPU."
            )
        index_text = text.partition(":")[2] or str(torch.cuda.current_device())
        if not index_text.isdigit():
            raise DeviceError(f"device {text!r} is not valid; write cuda or cuda:N with N a GPU index.")
        index, count = int(index_text), torch.cuda.device_count()
        if index >= count:
            raise DeviceError(
                f"device {text!r} does not exist: this machine has {count} GPU(s), "
                f"cuda:0 to cuda:{count - 1}. Pick one of those, or use --device auto."
            )
        return torch.device("cuda", index)
    raise DeviceError(f"device {text!r} is not supported; use one of: {', '.join(DEVICE_CHOICES)}.")


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """The dtype to load in: the device's best by default; refuses what the device cannot compute."""
    if dtype is None or (isinstance(dtype, str) and dtype.strip().lower() == "auto"):
        return default_dtype(device)
    if isinstance(dtype, str):
        name = dtype.strip().lower().removeprefix("torch.")
        if name not in DTYPE_NAMES:
            raise DeviceError(f"dtype {dtype!r} is not supported; use one of: {', '.join(DTYPE_CHOICES)}.")
        dtype = DTYPE_NAMES[name]
    if dtype not in set(DTYPE_NAMES.values()):
        raise DeviceError(f"dtype {dtype} is not supported; use one of: {', '.join(DTYPE_CHOICES)}.")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise DeviceError(
            f"{torch.cuda.get_device_name(device)} cannot compute bfloat16 (it needs compute capability 8.0 "
            "or newer); use --dtype float16 or --dtype float32."
        )
    return dtype


def default_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _CPU_BF16 else torch.float32


def free_memory(device: torch.device) -> int:
    """Bytes free for new tensors on `device` (available RAM for the CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def weight_bytes(config: Any, dtype: torch.dtype) -> int:
    """Bytes of the weights of the causal LM `config` describes, counted on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in model.parameters()) * itemsize


def place(config: Any, device: str | torch.device | None, dtype: torch.dtype | str | None) -> Placement:
    """Resolve device and dtype for a model and check that its weights fit, before loading them.

    With device "auto" or "cuda" (no index), a model too large for one GPU but small enough for
    all of them together is spread over them with device_map="auto".
    """
    target = resolve_device(device)
    chosen = resolve_dtype(dtype, target)
    needed = weight_bytes(config, chosen)
    free = free_memory(target)
    if needed <= WEIGHTS_SHARE_OF_FREE * free:
        return Placement(target, chosen)
    spreadable = str(device or "auto").strip().lower() in ("auto", "cuda") and target.type == "cuda"
    if spreadable and torch.cuda.device_count() > 1:
        total = sum(free_memory(torch.device("cuda", i)) for i in range(torch.cuda.device_count()))
        if needed <= WEIGHTS_SHARE_OF_FREE * total:
            return Placement(target, chosen, device_map="auto")
    where = "RAM" if target.type == "cpu" else f"{target} ({torch.cuda.get_device_name(target)})"
    smaller = " or float16/bfloat16" if chosen == torch.float32 else ""
    raise DeviceError(
        f"The model's weights need {needed / GIB:.1f} GiB in {str(chosen).removeprefix('torch.')}, "
        f"but {where} has {free / GIB:.1f} GiB free. Free memory, pick a smaller model{smaller}, "
        "or another --device."
    )
