"""Real servers for the API tests: uvicorn on 127.0.0.1 (a free port) serving tiny models."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from multiguess.api import ServerSettings, create_app
from multiguess.api.connections import ConnectionLimits, server_config
from multiguess.engine.config import EngineConfig
from multiguess.engine.drafters.base import Drafter
from multiguess.engine.drafters.model import ModelDrafter
from multiguess.engine.engine import Engine
from multiguess.engine.guard import GuardedDrafter
from multiguess.llm import load_pair
from multiguess.scheduler import Scheduler

from tests.api.faults import Faults, FaultyDrafter
from tests.servers import wait_ready

MODEL = "tiny"


@dataclass
class LiveServer:
    url: str
    app: FastAPI

    @property
    def scheduler(self) -> Scheduler:
        return self.app.state.scheduler

    @property
    def engine(self) -> Engine:
        assert self.scheduler.engine is not None
        return self.scheduler.engine

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, **kwargs)  # type: ignore[arg-type]


def tiny_loader(
    target: Path,
    draft: Path | None,
    config: EngineConfig,
    faults: Faults | None = None,
    step_timeout: float = 30.0,  # CI hiccups must not degrade a healthy server
) -> Callable[[], Engine]:
    """Builds the engine as ``serve`` does (drafter in a guard); ``faults`` injects failures
    between the two."""

    def load() -> Engine:
        target_model, draft_model = load_pair(
            str(target), str(draft) if draft else None, "float32", "cpu", None, None
        )
        drafter = None
        if draft_model is not None:
            inner: Drafter = ModelDrafter(draft_model)
            inner = FaultyDrafter(inner, faults) if faults else inner
            clock = faults.clock if faults else time.monotonic
            vocab = target_model.model.config.vocab_size
            drafter = GuardedDrafter(inner, vocab, step_timeout=step_timeout, cooldown=0.5, clock=clock)
        return Engine(target_model, drafter, config)

    return load


@pytest.fixture(scope="session")
def start_server() -> Iterator[Callable[..., LiveServer]]:
    """Starts servers on demand; all are stopped at the end of the session."""
    running: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(
        load: Callable[[], Engine], limits: ConnectionLimits | None = None, **settings: object
    ) -> LiveServer:
        """``limits``: the connection limits of the HTTP protocol ``serve`` runs (its defaults)."""
        app = create_app(load, ServerSettings(model_name=MODEL, **settings))  # type: ignore[arg-type]
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(server_config(app, limits, log_level="warning", timeout_graceful_shutdown=5))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        running.append((server, thread))
        live = LiveServer(f"http://127.0.0.1:{sock.getsockname()[1]}", app)
        wait_ready(live.url)
        return live

    yield start
    for server, _ in running:
        server.should_exit = True
    for _, thread in running:
        thread.join(10)


@pytest.fixture(scope="session")
def tiny_config() -> EngineConfig:
    # Fixed trees: with tiny models the draft costs as much as the target, and the adaptive
    # policy would (rightly) stop drafting; these tests need the speculative path exercised.
    return EngineConfig(
        num_candidates=3, depth=4, max_nodes=16, max_batch=8, max_model_len=256, adaptive=False
    )


@pytest.fixture(scope="session")
def server(
    start_server: Callable[..., LiveServer],
    tiny_llama: Path,
    tiny_llama_draft: Path,
    tiny_config: EngineConfig,
) -> LiveServer:
    """The shared server: speculation on, room for 16 requests at once."""
    return start_server(
        tiny_loader(tiny_llama, tiny_llama_draft, tiny_config), max_queue=16, request_timeout=60
    )
