"""The `rag-mspoe` command. Each feature area registers its own subcommands."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import warnings
from collections.abc import Sequence
from typing import Any

# (module, function) pairs; each function takes the subparsers object and adds its commands.
# Modules are imported lazily so `rag-mspoe --help` stays fast and optional extras stay optional.
COMMAND_MODULES: list[tuple[str, str]] = [
    ("rag_mspoe.calibrated.models_command", "register"),
    ("rag_mspoe.pipelines.cli", "register"),
    ("rag_mspoe.eval.demo_command", "register"),
    ("rag_mspoe.connectors.serve_command", "register"),
    ("rag_mspoe.eval.settings_search.cli", "register"),
    ("rag_mspoe.eval.cli", "register"),
]


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
