"""The draft server: a WebSocket endpoint for the draft protocol, plus health and metrics.

One worker thread owns the draft model or EAGLE-3 head (it is not thread-safe): it loads it,
then serves batches. Step messages from all connections queue up while a batch runs and the next batch
takes all of them, so several target servers share one batched draft forward. The event
loop only decodes, queues, and encodes.

Each connection first completes the handshake (``handshake``: with ``secret`` set, proof of
the shared secret) within ``handshake_timeout``; its sessions live in its own namespace and
are freed when it closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from multiguess.engine.config import EngineConfig
from multiguess.options import DRAFT_MAX_FRAME_BYTES
from multiguess.remote import handshake
from multiguess.remote.handshake import AuthenticationFailed
from multiguess.remote.hosted import Hosted
from multiguess.remote.metrics import ServerMetrics
from multiguess.remote.protocol import (
    PATH,
    PROTOCOL_ERROR,
    ProtocolError,
    ServerInfo,
    StepMessage,
    StepReply,
    decode_step,
    encode_reply,
    model_display_name,
    tokenizer_fingerprint,
)
from multiguess.remote.service import DraftService, feature_width

log = logging.getLogger(__name__)

TRY_AGAIN_LATER = 1013  # WebSocket close code: not ready (loading or failed)
POLICY_VIOLATION = 1008  # the handshake's proof of the secret failed
INTERNAL_ERROR = 1011


@dataclass(frozen=True)
class DraftServerSettings:
    max_sessions: int = 16
    idle_seconds: float = 300.0
    max_model_len: int = 2048
    max_tree_nodes: int = 64  # room past a sequence for its tree: max(max_nodes, candidates x depth)
    eager: bool = False  # plain PyTorch kernels, no prepacked CPU weights
    secret: bytes | None = field(default=None, repr=False)  # clients must prove they hold it
    max_client_sessions: int = 8  # sessions one connection may hold (a target's --max-batch)
    handshake_timeout: float = 10.0
    # The largest step message (an EAGLE-3 prompt's features make it large): announced to the
    # clients, and the WebSocket's own limit (uvicorn's ws_max_size) where the server runs.
    max_frame_bytes: int = DRAFT_MAX_FRAME_BYTES

    def __post_init__(self) -> None:
        sizes = (
            self.max_sessions,
            self.max_model_len,
            self.max_tree_nodes,
            self.max_client_sessions,
            self.max_frame_bytes,
        )
        if min(sizes) < 1 or self.idle_seconds <= 0 or self.handshake_timeout <= 0:
            raise ValueError(
                "max_sessions, max_model_len, max_tree_nodes, max_client_sessions, max_frame_bytes "
                "must be >= 1; "
                "idle_seconds and handshake_timeout > 0"
            )


# A job is a step message of one connection, or None: that connection closed.
Job = tuple[str, StepMessage | None, "Future[StepReply | None]"]


class DraftWorker:
    """The thread that loads the draft and serves queued step messages in batches."""

    def __init__(
        self,
        load: Callable[[], Hosted],
        settings: DraftServerSettings,
        metrics: ServerMetrics,
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

    def submit(self, client: str, message: StepMessage | None) -> Future[StepReply | None]:
        """Queue a step of ``client``'s connection, or (``None``) free its sessions."""
        future: Future[StepReply | None] = Future()
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
        hosted = self._load()
        s = self.settings
        drafter = hosted.drafter
        drafter.start(s.max_sessions, s.max_model_len + s.max_tree_nodes + 2, EngineConfig(eager=s.eager))
        self.info = ServerInfo(
            model=model_display_name(hosted.name),
            fingerprint=tokenizer_fingerprint(hosted.tokenizer),
            vocab_size=drafter.runner.vocab_size,
            max_model_len=s.max_model_len,
            max_sessions=s.max_sessions,
            feature_layers=drafter.feature_layers,
            feature_width=feature_width(drafter),
            max_frame_bytes=s.max_frame_bytes,
        )
        return DraftService(
            drafter, s.max_sessions, s.max_model_len, s.idle_seconds, per_client=s.max_client_sessions
        )

    def _serve(self, service: DraftService, all_jobs: list[Job]) -> None:
        jobs = []
        for client, message, future in all_jobs:
            if message is None:
                service.drop_client(client)
                future.set_result(None)
            else:
                jobs.append((client, message, future))
        self.metrics.sessions.set(len(service.sessions))
        if not jobs:
            return
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


def create_draft_app(load: Callable[[], Hosted], settings: DraftServerSettings | None = None) -> FastAPI:
    """``load`` loads the hosted drafter (``drafting.host_drafter``); it runs on the worker thread
    after startup."""
    settings = settings or DraftServerSettings()
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    worker = DraftWorker(load, settings, metrics)
    connections = itertools.count()

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
        connection = f"connection-{next(connections)}"
        try:
            code, reason = await converse(websocket, worker, connection)
        finally:
            metrics.connections.dec()
            with contextlib.suppress(Exception):  # the worker may have stopped meanwhile
                await asyncio.wrap_future(worker.submit(connection, None))
        if code is not None:
            with contextlib.suppress(Exception):  # the peer may be gone already
                await websocket.close(code, reason[:120])

    return app


async def authenticate(websocket: WebSocket, settings: DraftServerSettings) -> str:
    """The handshake's server side; returns the client's own name for itself (for logs)."""
    hello = handshake.parse_client_hello(await websocket.receive_text())
    nonce = handshake.new_nonce()
    await websocket.send_text(handshake.challenge(nonce, hello.nonce, settings.secret))
    claimed = handshake.parse_answer(await websocket.receive_text())
    if settings.secret is not None and not handshake.verified(
        settings.secret, "client", hello.nonce, nonce, claimed
    ):
        raise AuthenticationFailed(f"client {hello.client!r} did not prove it holds the draft secret")
    return hello.client


async def converse(websocket: WebSocket, worker: DraftWorker, connection: str) -> tuple[int | None, str]:
    """Handshake, then step after step until the client leaves; returns how to close otherwise.

    ``connection`` names this connection's sessions: no other connection can reach them."""
    assert worker.info is not None
    try:
        client = await asyncio.wait_for(
            authenticate(websocket, worker.settings), worker.settings.handshake_timeout
        )
        log.info("draft client %r connected as %s", client, connection)
        await websocket.send_text(worker.info.to_json())
        while True:
            message = decode_step(await websocket.receive_bytes())
            reply = await asyncio.wrap_future(worker.submit(connection, message))
            assert reply is not None
            await websocket.send_bytes(encode_reply(reply))
    except WebSocketDisconnect:
        return None, ""
    except AuthenticationFailed as exc:
        worker.metrics.auth_failures.inc()
        log.warning("refusing a draft connection: %s", exc)
        return POLICY_VIOLATION, "authentication failed"
    except TimeoutError:
        return POLICY_VIOLATION, f"no handshake within {worker.settings.handshake_timeout:g} s"
    except (ProtocolError, KeyError) as exc:  # KeyError: a text frame where bytes belong, or back
        log.warning("closing a draft connection: %s", exc)
        return PROTOCOL_ERROR, f"protocol error: {exc}"
    except Exception as exc:  # the worker stopped, or a batch failed: the client falls back
        log.warning("closing a draft connection: %s: %s", type(exc).__name__, exc)
        return INTERNAL_ERROR, f"{type(exc).__name__}: {exc}"
