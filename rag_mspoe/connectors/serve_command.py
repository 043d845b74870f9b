"""The `serve` command; the server itself (and FastAPI) is imported only when it runs."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
from typing import Any

from rag_mspoe.methods import AUTO, UNMODIFIED_NAMES, MethodConfig, method_name, parse_method
from rag_mspoe.models.command_options import add_engine_options, engine_options
from rag_mspoe.models.loading import source_name

API_KEY_ENV = "RAG_MSPOE_API_KEY"


def _method_option(text: str) -> tuple[str, MethodConfig]:
    name, sep, path = text.partition("=")
    if not sep or not name or "+" in name or name.lower() in UNMODIFIED_NAMES:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a new name without '+'), got {text!r}")
    try:
        config = parse_method(path)
    except (OSError, ValueError, TypeError) as exc:  # argparse would print only "invalid value"
        raise argparse.ArgumentTypeError(f"{name}: {exc}") from exc
    if config is None:
        raise argparse.ArgumentTypeError(
            f"{path!r} names the unmodified model; it is always served as '+none'"
        )
    return name, config


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve the model and its method over an OpenAI-compatible HTTP API"
    )
    parser.add_argument(
        "--method",
        default=AUTO,
        help="default method: none, pi, pi:2, mspoe, layerwise+pi, ..., calibrated (the config shipped "
        "for the model) or a config path (default: auto, the shipped config on requests of the document "
        "counts it was validated at, the unmodified model on the others and where none ships)",
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
        "--allow-unauthenticated",
        action="store_true",
        help="serve a non-loopback --host without an API key (refused otherwise)",
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name clients may reach the server by, besides the loopback names and the bound "
        "address (repeatable; '*' for any); other Host headers are refused, against DNS rebinding",
    )
    parser.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a web page origin (e.g. https://app.example) allowed to call the server from a browser "
        "(repeatable; '*' for any); other cross-origin requests are refused",
    )
    parser.add_argument(
        "--max-tokens-limit", type=int, default=1024, help="largest max_tokens a request may ask"
    )
    parser.add_argument("--max-request-bytes", type=int, default=1 << 20)
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a request body may take to arrive (408 past it)",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=30.0,
        help="seconds a request's headers may take to arrive, from the connection or the request's first "
        "byte (408 and the connection closed past it)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections (or requests in progress) past which new requests get a 503 at once "
        "(default: no limit)",
    )
    parser.add_argument(
        "--max-connections-per-client",
        type=int,
        default=None,
        help="open connections one client address may hold; its next ones get a 429 and are closed "
        "(default: no limit; leave it off behind a reverse proxy: every client has the proxy's address)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds one generation may take, waiting for the model included (503 past it; 0: no deadline)",
    )
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
    ray = parser.add_argument_group(
        "Ray Serve", "serve on Ray Serve replicas, each loading the model once (needs the [serve-ray] extra)"
    )
    ray.add_argument("--replicas", type=int, default=None, help="replicas of the model (default: no Ray)")
    ray.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="join a Ray cluster (auto, or ray://host:10001); alone: start a local Ray",
    )
    ray.add_argument(
        "--autoscaling",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="Ray Serve's autoscaling_config instead of --replicas, e.g. '{\"min_replicas\": 1, "
        '"max_replicas": 4, "target_ongoing_requests": 2}\'',
    )
    ray.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=8,
        help="requests one replica takes at once; Ray Serve's router sends the others elsewhere",
    )
    add_engine_options(parser)
    parser.set_defaults(func=_serve)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def check_exposure(host: str, api_key: str | None, allow_unauthenticated: bool) -> None:
    """Refuse to serve a non-loopback address to anyone on the network unless asked to."""
    if api_key is None and not allow_unauthenticated and not is_loopback(host):
        raise ValueError(
            f"--host {host} lets other machines use the model, and no API key is set; pass --api-key KEY "
            f"(or set ${API_KEY_ENV}), or --allow-unauthenticated if the network is trusted."
        )


def allowed_hosts(host: str, extra: list[str]) -> list[str]:
    """Loopback names, the bound address when it is one clients can use, and the names given."""
    from rag_mspoe.connectors.request_guard import LOOPBACK_HOSTS

    bound = [] if host in ("0.0.0.0", "::", "") else [host]
    return [*LOOPBACK_HOSTS, *bound, *extra]


def _serve(args: argparse.Namespace) -> int:
    api_key = args.api_key or None  # an empty key (an unset variable's value) is no key
    check_exposure(args.host, api_key, args.allow_unauthenticated)
    parse_method(args.method, source_name(args.model))  # a bad default method fails before the model loads
    try:
        import uvicorn

        from rag_mspoe.connectors.client_limit import protocol_with
        from rag_mspoe.connectors.server import create_app
    except ImportError as exc:
        raise RuntimeError(
            f"serve needs the [serve] extra ({exc}); install it with: pip install 'rag-mspoe[serve]'"
        ) from exc
    from rag_mspoe.engine import Engine

    # Bad limits fail before the model loads.
    if not args.header_timeout > 0:
        raise ValueError(f"--header-timeout must be a positive number of seconds, got {args.header_timeout}.")
    if args.max_connections is not None and args.max_connections < 1:
        raise ValueError(f"--max-connections must be at least 1, got {args.max_connections}.")
    if args.max_connections_per_client is not None and args.max_connections_per_client < 1:
        raise ValueError(
            f"--max-connections-per-client must be at least 1, got {args.max_connections_per_client}."
        )
    app_options = {
        "api_key": api_key,
        "allowed_hosts": allowed_hosts(args.host, args.allowed_host),
        "cors_origins": args.cors_origin,
        "extra_methods": dict(args.method_config),
        "max_tokens_limit": args.max_tokens_limit,
        "max_request_bytes": args.max_request_bytes,
        "body_timeout_s": args.body_timeout,
        "request_timeout_s": args.request_timeout or None,
        "max_batch_size": args.max_batch_size,
        "batch_wait_ms": args.batch_wait_ms,
    }
    if args.replicas is not None or args.ray is not None or args.autoscaling is not None:
        return _serve_on_ray(args, app_options)
    engine = Engine.load(args.model, method=args.method, **engine_options(args))
    app = create_app(engine, **app_options)
    print(f"Serving {engine.name} ({method_name(engine.method)}) on http://{args.host}:{args.port}/v1")
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        http=protocol_with(args.header_timeout, args.max_connections_per_client),
        limit_concurrency=args.max_connections,
    )
    return 0


def _serve_on_ray(args: argparse.Namespace, app_options: dict[str, Any]) -> int:
    """The same app on Ray Serve replicas (`rag_mspoe.connectors.ray_serve`)."""
    if args.replicas is not None and args.autoscaling is not None:
        raise ValueError("Give --replicas N or --autoscaling JSON, not both: autoscaling sets the count.")
    if args.replicas is not None and args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}.")
    if args.max_connections is not None or args.max_connections_per_client is not None:
        raise ValueError(
            "--max-connections and --max-connections-per-client limit the single-process server's "
            "sockets; under Ray Serve its proxy holds the connections: drop them (--max-ongoing-requests "
            "bounds each replica)."
        )
    try:
        from rag_mspoe.connectors.ray_serve import ReplicaSettings, deployment, serve_on_ray
    except ImportError as exc:
        raise RuntimeError(
            f"--replicas and --ray need Ray Serve ({exc}); install it with: "
            "pip install 'rag-mspoe[serve-ray]'"
        ) from exc
    threads = args.threads or 1  # a replica's share of the CPUs, which Ray reserves for it
    settings = ReplicaSettings(
        args.model, args.method, {**engine_options(args), "threads": threads}, app_options
    )
    replicas = args.replicas or 1
    application = deployment(
        settings,
        replicas=None if args.autoscaling is not None else replicas,
        autoscaling=args.autoscaling,
        cpus_per_replica=float(threads),
        max_ongoing_requests=args.max_ongoing_requests,
    )
    scale = f"autoscaling {args.autoscaling}" if args.autoscaling is not None else f"{replicas} replicas"
    print(f"Serving on Ray Serve ({scale}) on http://{args.host}:{args.port}/v1")
    serve_on_ray(application, address=args.ray, host=args.host, port=args.port)
    return 0
