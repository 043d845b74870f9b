"""The `rag-mspoe` command. Each feature area registers its own subcommands."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import warnings
from collections.abc import Sequence
from typing import Any

# As rag_mspoe.models.devices.DTYPE_CHOICES and rag_mspoe.models.quantization.QUANTIZE_CHOICES (a test keeps
# them equal); importing torch would slow --help.
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
QUANTIZE_CHOICES = ("none", "int4", "int8", "int4-exact")

# (module, function) pairs; each function takes the subparsers object and adds its commands.
# Modules are imported lazily so `rag-mspoe --help` stays fast and optional extras stay optional.
COMMAND_MODULES: list[tuple[str, str]] = [
    ("rag_mspoe.models.models_command", "register"),
    ("rag_mspoe.pipelines.cli", "register"),
    ("rag_mspoe.connectors.serve_command", "register"),
    ("rag_mspoe.calibration.cli", "register"),
    ("rag_mspoe.eval.cli", "register"),
]


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """--model, --device, --dtype, --threads and --quantize, for every command that loads a model."""
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
        default="none",
        help="int4 / int8: Linear layers' weights in 4 / 8 bits on the CPU (decoding 2.7x / 1.8x as fast, "
        "but scores move; int4-exact: int4 only where a GGUF file's weights are 4-bit, int8 elsewhere; "
        "default none; docs/cpu-inference.md)",
    )


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The model options, and --compile, for commands that generate through one engine."""
    add_model_options(parser)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rag-mspoe",
        description="Local RAG with a model that carries a method against 'lost in the middle'.",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log progress details, and show the loading bars of transformers and huggingface_hub",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name, function_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # an optional extra is not installed
            logging.getLogger(__name__).debug("commands of %s unavailable: %s", module_name, exc)
            continue
        getattr(module, function_name)(subparsers)
    return parser


def _note(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
    print(f"note: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if not args.verbose:
        from rag_mspoe.progress import silence_library_bars

        silence_library_bars()
        warnings.showwarning = _note  # a command's warnings read as notes, not as source lines
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    # OSError: a path the system refuses (read-only, too long, a file in the way), as a message.
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
