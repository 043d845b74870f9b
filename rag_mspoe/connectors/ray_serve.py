"""The OpenAI-compatible server on Ray Serve replicas: one model (with its method) per replica,
requests spread by Ray Serve's router, on one machine or a cluster.

    rag-mspoe serve --replicas 2                              # a local Ray, two replicas
    rag-mspoe serve --ray auto --autoscaling '{"min_replicas": 1, "max_replicas": 8}'

Each replica builds the very app `rag-mspoe serve` runs (`server.create_app`) around its own
engine, and Ray Serve's ingress hands it the HTTP requests: the same routes, request guard
(Host, Origin, API key, body size), error shape, streaming and cancellation of abandoned
requests. What the ingress adds: the header `x-rag-mspoe-replica` naming the replica that
answered, and in /health every replica of the deployment (each one reports itself to a small
board actor every second; one silent for `GONE_AFTER_S` is listed as gone).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve

from rag_mspoe.methods import AUTO

NAMESPACE = "rag-mspoe"
APP_NAME = DEPLOYMENT_NAME = "rag-mspoe"
REPLICA_HEADER = "x-rag-mspoe-replica"
BEAT_EVERY_S = 1.0
GONE_AFTER_S = 5.0


@dataclass(frozen=True)
class ReplicaSettings:
    """What every replica loads and serves: `Engine.load`'s arguments and `create_app`'s options."""

    model: str | None = None
    method: str | None = AUTO  # the shipped method where validated (`rag_mspoe.methods.where_validated`)
    engine: dict[str, Any] = field(default_factory=dict)  # device, dtype, threads, quantize, compile
    app: dict[str, Any] = field(default_factory=dict)  # create_app's keyword arguments


@ray.remote(num_cpus=0)
class ReplicaBoard:
    """Where the replicas of one deployment say they are alive, and what they serve."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[float, dict[str, Any]]] = {}

    def beat(self, replica: str, facts: dict[str, Any]) -> None:
        self.seen[replica] = (time.time(), facts)

    def replicas(self) -> list[dict[str, Any]]:
        now = time.time()
        return [
            {
                "replica": replica,
                "status": "ok" if now - last < GONE_AFTER_S else "gone",
                "seconds_since_seen": round(now - last, 1),
                **facts,
            }
            for replica, (last, facts) in sorted(self.seen.items())
        ]


def board_name(app: str, deployment: str) -> str:
    return f"board:{app}:{deployment}"


class ReplicaHeader:
    """ASGI middleware: every response names the replica that made it."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app, self.replica = app, replica.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def named(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (REPLICA_HEADER.encode(), self.replica)],
                }
            await send(message)

        await self.app(scope, receive, named if scope["type"] == "http" else send)


class ModelReplica:
    """One replica: the engine loaded once, the server's app around it, a heartbeat to the board."""

    def __init__(self, settings: ReplicaSettings) -> None:
        from rag_mspoe.connectors.server import create_app
        from rag_mspoe.engine import Engine
        from rag_mspoe.methods import method_name

        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        engine = Engine.load(settings.model, method=settings.method, **settings.engine)
        self.board = ReplicaBoard.options(  # type: ignore[attr-defined]
            name=board_name(context.app_name, context.deployment),
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",  # outlives the replica that made it; `serve_on_ray` removes it
        ).remote()
        facts = {
            "model": engine.name,
            "method": method_name(engine.method),
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }
        self._app = create_app(engine, **settings.app, health_details=self.health_details)
        self._app.add_middleware(ReplicaHeader, replica=self.replica)
        self._stop = threading.Event()
        threading.Thread(target=self._beat, args=(facts,), daemon=True, name="replica-heartbeat").start()

    def __serve_build_asgi_app__(self) -> Any:
        return self._app

    async def health_details(self) -> dict[str, Any]:
        return {"replica": self.replica, "replicas": await self.board.replicas.remote()}

    def _beat(self, facts: dict[str, Any]) -> None:
        while not self._stop.wait(BEAT_EVERY_S if self._announce(facts) else 0.2):
            pass

    def _announce(self, facts: dict[str, Any]) -> bool:
        try:
            ray.get(self.board.beat.remote(self.replica, facts), timeout=10)
        except (ray.exceptions.RayError, TimeoutError):  # the board restarting: try again soon
            return False
        return True

    def __del__(self) -> None:
        self._stop.set()


def deployment(
    settings: ReplicaSettings,
    replicas: int | None = 1,
    autoscaling: dict[str, Any] | None = None,
    cpus_per_replica: float = 1.0,
    max_ongoing_requests: int = 8,
) -> Any:
    """The bound Ray Serve application: `replicas` replicas, or as many as `autoscaling` (Ray Serve's
    autoscaling_config: min_replicas, max_replicas, target_ongoing_requests, ...) decides."""
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": {"num_cpus": cpus_per_replica},
        "max_ongoing_requests": max_ongoing_requests,
    }
    if autoscaling is not None:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = replicas
    ingress = serve.ingress()(ModelReplica)
    return serve.deployment(**options)(ingress).bind(settings)


def serve_on_ray(application: Any, *, address: str | None, host: str, port: int) -> None:
    """Start Ray (a local one for None or "local", else join `address`), run `application` on
    host:port, and block until interrupted; then remove it."""
    if not ray.is_initialized():
        ray.init(address=None if address in (None, "local") else address, namespace=NAMESPACE)
    serve.start(http_options={"host": host, "port": port})
    serve.run(application, name=APP_NAME, route_prefix="/")
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        shutdown()


def shutdown() -> None:
    """Remove the application and its replica board."""
    serve.delete(APP_NAME)
    with contextlib.suppress(ValueError):  # no replica ever made it
        ray.kill(ray.get_actor(board_name(APP_NAME, DEPLOYMENT_NAME), namespace=NAMESPACE))
