"""The `serve` command; the server itself (and FastAPI) is imported only when it runs."""

from __future__ import annotations

import argparse
import os
from typing import Any

from rag_mspoe.cli import add_engine_options, engine_options
from rag_mspoe.methods import UNMODIFIED_NAMES, MethodConfig, method_name, parse_method

API_KEY_ENV = "RAG_MSPOE_API_KEY"


def _method_option(text: str) -> tuple[str, MethodConfig]:
    name, sep, path = text.partition("=")
    if not sep or not name or "+" in name or name.lower() in UNMODIFIED_NAMES:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a new name without '+'), got {text!r}")
    config = parse_method(path)
    if config is None:
        raise argparse.ArgumentTypeError(
            f"{path!r} names the unmodified model; it is always served as '+none'"
        )
    return name, config


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve the rescaled model over an OpenAI-compatible HTTP API"
    )
    parser.add_argument(
        "--method",
        default="mspoe",
        help="default method: none, pi, mspoe, ..., calibrated (the config shipped for the model) "
        "or a config path",
    )
    parser.add_argument(
        "--method-config",
        action="append",
        type=_method_option,
        default=[],
        metavar="NAME=PATH",
        help="serve a saved method config as '<model>+NAME' (repeatable)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require this bearer token (default: ${API_KEY_ENV}, unset: no key)",
    )
    parser.add_argument(
        "--max-tokens-limit", type=int, default=1024, help="largest max_tokens a request may ask"
    )
    parser.add_argument("--max-request-bytes", type=int, default=1 << 20)
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=1,
        help="run up to this many greedy requests with equal settings as one batch (default 1: off; "
        "more throughput under load, but bf16 answers can then drift from a request alone; "
        "--dtype float32 makes batched answers equal answers alone)",
    )
    parser.add_argument(
        "--batch-wait-ms", type=float, default=10.0, help="how long a request waits for others to batch with"
    )
    add_engine_options(parser)
    parser.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from rag_mspoe.connectors.server import create_app
    except ImportError as exc:
        raise RuntimeError(
            f"serve needs the [serve] extra ({exc}); install it with: pip install 'rag-mspoe[serve]'"
        ) from exc
    from rag_mspoe.engine import Engine

    engine = Engine.load(args.model, method=args.method, **engine_options(args))
    app = create_app(
        engine,
        api_key=args.api_key,
        extra_methods=dict(args.method_config),
        max_tokens_limit=args.max_tokens_limit,
        max_request_bytes=args.max_request_bytes,
        max_batch_size=args.max_batch_size,
        batch_wait_ms=args.batch_wait_ms,
    )
    print(f"Serving {engine.name} ({method_name(engine.method)}) on http://{args.host}:{args.port}/v1")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
