"""The FastAPI application: lifespan (the scheduler), health, models, metrics, generation."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from multiguess.api import errors
from multiguess.api.gate import BODY_TIMEOUT, OPEN_PATHS, RequestGate
from multiguess.api.generation import router as generation_router
from multiguess.api.keys import DEFAULT_TENANT
from multiguess.api.schemas import ModelCard, ModelList
from multiguess.engine.engine import Engine
from multiguess.metrics import Metrics
from multiguess.scheduler import Scheduler

MAX_BODY = 4 * 1024 * 1024


@dataclass(frozen=True)
class ServerSettings:
    model_name: str = "multiguess-default"
    max_queue: int = 64
    request_timeout: float = 600.0
    warmup: bool = True
    max_body: int = MAX_BODY  # bytes of one request body at most (413 beyond)
    body_timeout: float = BODY_TIMEOUT  # seconds a body may take to arrive after its head (408 beyond)
    api_key: str | None = field(default=None, repr=False)  # Bearer key for all but health (and metrics)
    api_keys: Mapping[str, str] = field(default_factory=dict, repr=False)  # more keys: key -> tenant
    protect_metrics: bool = False  # /metrics needs the API key too

    def tenants(self) -> dict[str, str]:
        """Every accepted key and its tenant; ``api_key`` is tenant ``default``'s."""
        single = {self.api_key: DEFAULT_TENANT} if self.api_key else {}
        return {**self.api_keys, **single}


def readiness(scheduler: Scheduler) -> tuple[int, dict[str, str]]:
    """Ready once warmed up. A degraded drafter keeps the pod ready: the target alone still
    serves exact output, only slower, and pulling every pod at once would be worse."""
    if scheduler.state != "ready" or scheduler.engine is None:
        return 503, {"status": scheduler.state, "reason": scheduler.not_ready_message()}
    drafter = scheduler.engine.drafter
    if drafter is not None and drafter.degraded:
        return 200, {"status": "degraded", "reason": drafter.reason or "draft unavailable"}
    return 200, {"status": "ready"}


def without_validation_status(build: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """FastAPI lists its validation error as a 422 for every body; this API answers invalid
    bodies with 400 (as OpenAI does), so the document must not promise it. The generation
    endpoints' own 422 (a grammar that failed during generation) stays."""

    def document() -> dict[str, Any]:
        schema = build()
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.get("responses", {})
                if "HTTPValidationError" in str(responses.get("422", "")):
                    del responses["422"]
        return schema

    return document


def create_app(load: Callable[[], Engine], settings: ServerSettings | None = None) -> FastAPI:
    """``load`` builds the engine; it runs on the engine's worker thread, after startup."""
    settings = settings or ServerSettings()
    metrics = Metrics()
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler = Scheduler(load, metrics, settings.max_queue, settings.request_timeout, settings.warmup)
        app.state.scheduler = scheduler
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="multiguess", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics
    errors.install(app)
    open_paths = OPEN_PATHS if settings.protect_metrics else OPEN_PATHS | {"/metrics"}
    app.add_middleware(
        RequestGate,
        max_body=settings.max_body,
        api_keys=settings.tenants(),
        open_paths=open_paths,
        body_timeout=settings.body_timeout,
    )
    app.include_router(generation_router, responses=errors.GENERATION_ERRORS)
    app.openapi = without_validation_status(app.openapi)

    @app.get("/health/live", responses={503: {"description": "the engine failed; restart"}})
    async def live(request: Request) -> JSONResponse:
        scheduler: Scheduler = request.app.state.scheduler
        if scheduler.alive:
            return JSONResponse({"status": "alive"})
        return JSONResponse({"status": "failed", "reason": scheduler.not_ready_message()}, status_code=503)

    @app.get("/health/ready", responses={503: {"description": "loading, failed or shutting down"}})
    async def ready(request: Request) -> JSONResponse:
        status, body = readiness(request.app.state.scheduler)
        return JSONResponse(body, status_code=status)

    @app.get("/v1/models", response_model=ModelList, responses=errors.error_responses(401))
    async def models(request: Request) -> Any:
        engine = request.app.state.scheduler.engine
        max_len = engine.config.max_model_len if engine else 0
        return ModelList(data=[ModelCard(id=settings.model_name, created=created, max_model_len=max_len)])

    @app.get("/metrics", response_class=Response, responses=errors.error_responses(401))
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
