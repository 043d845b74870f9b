"""The command-line options of every command that loads a model, and what they mean to `load_model`
and `Engine.load`: shared by the commands of the pipelines, the server, the evaluation and the
settings search."""

from __future__ import annotations

import argparse
from typing import Any

# As rag_mspoe.models.devices.DTYPE_CHOICES and rag_mspoe.models.quantization.QUANTIZE_CHOICES (a test keeps
# them equal); importing torch would slow --help.
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
QUANTIZE_CHOICES = (
    "auto",
    "none",
    "int4",
    "int8",
    "int4-exact",
    "int8-prompt",
    "int8-prompt+int4",
    "int8-prompt+int4-decoding",
    "int8-decoding",
    "int4-decoding",
)


def add_model_options(parser: argparse.ArgumentParser, quantize: str = "none") -> None:
    """--model, --device, --dtype, --threads and --quantize (default `quantize`), for every command
    that loads a model."""
    parser.add_argument(
        "--model",
        default=None,
        help="an embedded model's name (see `rag-mspoe models`), a model folder, a .gguf file or a hub id "
        "(default: the embedded smollm2-135m-instruct)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        metavar="{auto,cpu,cuda,cuda:N}",
        help="where the model runs (default auto: the GPU when there is one, else the CPU)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default=None,
        help="weights' dtype (default auto: bf16 on GPUs that compute it, else fp16; "
        "on CPUs bf16 where native, else fp32)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: the CPUs the load average shows free, at least one)",
    )
    parser.add_argument(
        "--quantize",
        choices=QUANTIZE_CHOICES,
        default=quantize,
        help="int4 / int8: Linear layers' weights in 4 / 8 bits on the CPU (decoding 2.7x / 1.8x as fast, "
        "but scores move; int4-exact: int4 only where a GGUF file's weights are 4-bit, int8 elsewhere; "
        "int8-prompt: the MLP's gate and up projections read the prompt in int8, decoding unchanged; "
        "int8-prompt+int4: that read, decoding on a GGUF file's own 4-bit codes where it has them; "
        "int8-prompt+int4-decoding: and on int8 codes elsewhere; "
        "int8-decoding / int4-decoding: the prompt read unchanged, decoding on int8 codes / on the file's "
        "4-bit codes where it has them (for float32, on a CPU without native bf16); "
        "auto: the scheme measured for an embedded Qwen model on the CPU (in bf16: int8-prompt for the "
        "0.5B, int8-prompt+int4-decoding for the 1.5B; in float32: int8-decoding / int4-decoding), "
        "none otherwise; "
        f"default {quantize}; docs/cpu-inference.md)",
    )


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The model options (--quantize auto, as `Engine.load`), and --compile, for commands that
    generate through one engine."""
    add_model_options(parser, quantize="auto")
    parser.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="decode on a static KV cache with a compiled forward (default auto: on GPUs, not on CPUs)",
    )


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `Engine.load` keyword arguments the options of `add_engine_options` give."""
    compile_choice: dict[str, Any] = {"auto": "auto", "on": True, "off": False}
    return {**model_load_options(args), "compile": compile_choice[args.compile]}


def model_load_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `load_model` / `Engine.load` keyword arguments the options of `add_model_options` give.

    A device this machine lacks, or a dtype it cannot compute, fails here: call this before
    any long work (indexing, data preparation).
    """
    from rag_mspoe.models.devices import resolve_device, resolve_dtype
    from rag_mspoe.models.quantization import resolve_quantize

    device = resolve_device(args.device)
    resolve_dtype(args.dtype, device)
    quantize = resolve_quantize(args.quantize, device, args.dtype)
    return {"device": args.device, "dtype": args.dtype, "threads": args.threads, "quantize": quantize}
