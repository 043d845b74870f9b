"""The models the server answers to, each a method on the one engine, and the routes that list
them: GET /v1/models, and GET /health with the default method and the batcher's counts."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI

from rag_mspoe.calibrated import calibrated_config_path
from rag_mspoe.connectors.batching import RequestBatcher
from rag_mspoe.connectors.server_errors import ApiError
from rag_mspoe.engine import ENGINE_DEFAULT, Engine, EngineDefault
from rag_mspoe.methods import AUTO, CALIBRATED, NAMED_METHODS, MethodConfig, method_name, parse_method
from rag_mspoe.models.loading import model_display_name


class ModelRoutes:
    """Model names the server answers to, each a method on the one engine."""

    def __init__(self, engine: Engine, extra_methods: dict[str, MethodConfig] | None = None) -> None:
        self.engine = engine
        self.methods: dict[str, MethodConfig | None] = {"none": None}
        named = {name: parse_method(name) for name in NAMED_METHODS}
        self.methods.update({n: m for n, m in named.items() if m is not None})
        if calibrated_config_path(model_display_name(engine.model)) is not None:
            self.methods[CALIBRATED] = engine.method_config(CALIBRATED)  # only where one ships
            self.methods[AUTO] = engine.method_config(AUTO)  # it, at its validated document counts
        self.methods.update(extra_methods or {})

    def names(self) -> list[str]:
        return [self.engine.name] + [f"{self.engine.name}+{name}" for name in self.methods]

    def method_for(self, model: str) -> MethodConfig | None | EngineDefault:
        """The method a model name asks for (None: unmodified); ENGINE_DEFAULT for the server's default."""
        base, plus, suffix = model.partition("+")
        if base != self.engine.name or (plus and suffix not in self.methods):  # "<name>+" is no name
            raise ApiError(
                404,
                f"The model {model!r} does not exist; available: {', '.join(self.names())}.",
                code="model_not_found",
                param="model",
            )
        return self.methods[suffix] if suffix else ENGINE_DEFAULT


def add_model_routes(
    app: FastAPI,
    routes: ModelRoutes,
    batcher: RequestBatcher,
    health_details: Callable[[], Awaitable[dict[str, Any]]] | None,
) -> None:
    """GET /health and GET /v1/models."""
    engine = routes.engine
    started = int(time.time())

    # The endpoints keep their names and carry no docstring: FastAPI makes the OpenAPI operation
    # ids and descriptions from them.
    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": engine.name,
            "method": method_name(engine.method),
            "batching": batcher.stats(),
            **(await health_details() if health_details is not None else {}),
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [
            {"id": n, "object": "model", "created": started, "owned_by": "rag-mspoe"} for n in routes.names()
        ]
        return {"object": "list", "data": data}
