"""The draft server: a WebSocket endpoint for the draft protocol, plus health and metrics.

One worker thread owns the draft model (it is not thread-safe): it loads it, then serves
batches. Step messages from all connections queue up while a batch runs and the next batch
takes all of them, so several target servers share one batched draft forward. The event
loop only decodes, queues, and encodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from multiguess.engine.runner import NativeRunner
from multiguess.models.loading import LoadedModel
from multiguess.remote.metrics import ServerMetrics
from multiguess.remote.protocol import (
    PATH,
    ProtocolError,
    ServerInfo,
    StepMessage,
    StepReply,
    decode_step,
    encode_reply,
    parse_client_hello,
    tokenizer_fingerprint,
)
from multiguess.remote.service import DraftService

log = logging.getLogger(__name__)

TRY_AGAIN_LATER = 1013  # WebSocket close code: not ready (loading or failed)
PROTOCOL_ERROR = 1002
INTERNAL_ERROR = 1011


@dataclass(frozen=True)
class DraftServerSettings:
    max_sessions: int = 16
    idle_seconds: float = 300.0
    max_model_len: int = 2048
    max_tree_nodes: int = 64  # room past a sequence for its tree: max(max_nodes, candidates x depth)
    eager: bool = False  # plain PyTorch kernels, no prepacked CPU weights

    def __post_init__(self) -> None:
        if min(self.max_sessions, self.max_model_len, self.max_tree_nodes) < 1 or self.idle_seconds <= 0:
            raise ValueError("max_sessions, max_model_len, max_tree_nodes must be >= 1 and idle_seconds > 0")


Job = tuple[str, StepMessage, "Future[StepReply]"]


class DraftWorker:
    """The thread that loads the draft and serves queued step messages in batches."""

    def __init__(
        self, load: Callable[[], LoadedModel], settings: DraftServerSettings, metrics: ServerMetrics
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.state = "loading"  # loading -> ready -> stopped; or failed
        self.reason: str | None = None
        self.info: ServerInfo | None = None
        self._load = load
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="multiguess-draft", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def submit(self, client: str, message: StepMessage) -> Future[StepReply]:
        future: Future[StepReply] = Future()
        if self.state != "ready":
            future.set_exception(RuntimeError(f"draft server is {self.state}"))
        else:
            self._jobs.put((client, message, future))
        return future

    def _main(self) -> None:
        try:
            service = self._build()
        except Exception as exc:
            log.exception("loading the draft failed")
            self.state, self.reason = "failed", f"{type(exc).__name__}: {exc}"
            return
        self.state = "ready"
        log.info("draft server ready: %s", self.info)
        while True:
            first = self._jobs.get()
            if first is None:
                break
            jobs = [first]
            while True:  # everything that queued meanwhile joins this batch
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._jobs.put(None)
                    break
                jobs.append(job)
            self._serve(service, jobs)
        self.state = "stopped"
        while True:  # whatever queued behind the stop gets an answer: its client falls back
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job[2].set_exception(RuntimeError("draft server stopped"))

    def _build(self) -> DraftService:
        loaded = self._load()
        s = self.settings
        capacity = s.max_model_len + s.max_tree_nodes + 2
        runner = NativeRunner(loaded, s.max_sessions, capacity, s.eager, loaded.draft_vocab)
        self.info = ServerInfo(
            model=loaded.name,
            fingerprint=tokenizer_fingerprint(loaded.tokenizer),
            vocab_size=runner.vocab_size,
            max_model_len=s.max_model_len,
            max_sessions=s.max_sessions,
        )
        return DraftService(runner, s.max_sessions, s.max_model_len, s.idle_seconds)

    def _serve(self, service: DraftService, jobs: list[Job]) -> None:
        started = time.perf_counter()
        try:
            replies, events = service.handle([(client, message) for client, message, _ in jobs])
        except Exception as exc:  # a bug must not kill the worker: fail this batch only
            log.exception("draft batch failed")
            for *_, future in jobs:
                future.set_exception(exc)
            return
        elapsed = time.perf_counter() - started
        for (*_, future), reply in zip(jobs, replies, strict=True):
            reply.server_seconds = elapsed
            future.set_result(reply)
        m = self.metrics
        if events.drafted:
            m.step.observe(events.propose_seconds)
            m.batch.observe(events.drafted)
        m.requests.inc(events.drafted)
        m.resends.inc(events.resends)
        m.failed.inc(events.failed)
        m.evictions.labels(reason="lru").inc(events.evicted_lru)
        m.evictions.labels(reason="idle").inc(events.evicted_idle)
        m.sessions.set(len(service.sessions))


def create_draft_app(load: Callable[[], LoadedModel], settings: DraftServerSettings | None = None) -> FastAPI:
    """``load`` loads the draft model; it runs on the worker thread after startup."""
    settings = settings or DraftServerSettings()
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    worker = DraftWorker(load, settings, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="multiguess draft server", version="0.1.0", lifespan=lifespan)
    app.state.worker = worker
    app.state.metrics = metrics

    @app.get("/health/live")
    async def live() -> JSONResponse:
        if worker.state == "failed":
            return JSONResponse({"status": "failed", "reason": worker.reason}, status_code=503)
        return JSONResponse({"status": "alive"})

    @app.get("/health/ready")
    async def ready() -> JSONResponse:
        if worker.state != "ready":
            return JSONResponse({"status": worker.state, "reason": worker.reason}, status_code=503)
        return JSONResponse({"status": "ready", "model": worker.info.model if worker.info else None})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.websocket(PATH)
    async def draft(websocket: WebSocket) -> None:
        await websocket.accept()
        if worker.state != "ready" or worker.info is None:
            await websocket.close(TRY_AGAIN_LATER, f"draft server is {worker.state}")
            return
        metrics.connections.inc()
        try:
            code, reason = await converse(websocket, worker)
        finally:
            metrics.connections.dec()
        if code is not None:
            with contextlib.suppress(Exception):  # the peer may be gone already
                await websocket.close(code, reason[:120])

    return app


async def converse(websocket: WebSocket, worker: DraftWorker) -> tuple[int | None, str]:
    """Hello, then step after step until the client leaves; returns how to close otherwise."""
    assert worker.info is not None
    try:
        client = parse_client_hello(await websocket.receive_text())
        await websocket.send_text(worker.info.to_json())
        while True:
            message = decode_step(await websocket.receive_bytes())
            reply = await asyncio.wrap_future(worker.submit(client, message))
            await websocket.send_bytes(encode_reply(reply))
    except WebSocketDisconnect:
        return None, ""
    except (ProtocolError, KeyError) as exc:  # KeyError: a text frame where bytes belong, or back
        log.warning("closing a draft connection: %s", exc)
        return PROTOCOL_ERROR, f"protocol error: {exc}"
    except Exception as exc:  # the worker stopped, or a batch failed: the client falls back
        log.warning("closing a draft connection: %s: %s", type(exc).__name__, exc)
        return INTERNAL_ERROR, f"{type(exc).__name__}: {exc}"
