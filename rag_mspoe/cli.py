"""The `rag-mspoe` command. Each feature area registers its own subcommands."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# (module, function) pairs; each function takes the subparsers object and adds its commands.
# Modules are imported lazily so `rag-mspoe --help` stays fast and optional extras stay optional.
COMMAND_MODULES: list[tuple[str, str]] = [
    ("rag_mspoe.models_command", "register"),
    ("rag_mspoe.pipelines.cli", "register"),
    ("rag_mspoe.connectors.serve_command", "register"),
    ("rag_mspoe.calibration.cli", "register"),
    ("rag_mspoe.eval.cli", "register"),
]


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """--model and --threads, as every command that loads a model takes them."""
    parser.add_argument(
        "--model",
        default=None,
        help="an embedded model's name (see `rag-mspoe models`), a model folder, a .gguf file or a hub id "
        "(default: the embedded smollm2-135m-instruct)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: half the CPUs)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rag-mspoe",
        description="Local RAG with a model whose RoPE is rescaled against 'lost in the middle'.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name, function_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # an optional extra is not installed
            logging.getLogger(__name__).debug("commands of %s unavailable: %s", module_name, exc)
            continue
        getattr(module, function_name)(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
