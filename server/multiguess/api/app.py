"""The FastAPI application: lifespan (the scheduler), health, models, metrics, generation."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from multiguess.api import errors
from multiguess.api.generation import router as generation_router
from multiguess.api.schemas import ModelCard, ModelList
from multiguess.engine.engine import Engine
from multiguess.metrics import Metrics
from multiguess.scheduler import Scheduler


@dataclass(frozen=True)
class ServerSettings:
    model_name: str = "multiguess-default"
    max_queue: int = 64
    request_timeout: float = 600.0
    warmup: bool = True


def readiness(scheduler: Scheduler) -> tuple[int, dict[str, str]]:
    """Ready once warmed up. A degraded drafter keeps the pod ready: the target alone still
    serves exact output, only slower, and pulling every pod at once would be worse."""
    if scheduler.state != "ready" or scheduler.engine is None:
        return 503, {"status": scheduler.state, "reason": scheduler.not_ready_message()}
    drafter = scheduler.engine.drafter
    if getattr(drafter, "degraded", False):
        return 200, {"status": "degraded", "reason": str(getattr(drafter, "reason", "draft unavailable"))}
    return 200, {"status": "ready"}


class JsonBodies:
    """Read every POST body as JSON, whatever its content type: every body this API takes is
    JSON, and ``curl -d '{"prompt": ...}' /generate`` (the original guide's call) sends it as a
    form. Without this such a request fails with a puzzling validation error."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
            scope = dict(scope, headers=[*headers, (b"content-type", b"application/json")])
        await self.app(scope, receive, send)


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
    app.add_middleware(JsonBodies)
    app.include_router(generation_router)

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

    @app.get("/v1/models", response_model=ModelList)
    async def models(request: Request) -> Any:
        engine = request.app.state.scheduler.engine
        max_len = engine.config.max_model_len if engine else 0
        return ModelList(data=[ModelCard(id=settings.model_name, created=created, max_model_len=max_len)])

    @app.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
