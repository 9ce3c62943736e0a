"""Real draft servers on 127.0.0.1 (uvicorn, WebSocket) and engines that draft through them."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from multiguess.drafting import DraftOptions, host_drafter
from multiguess.engine.config import EngineConfig
from multiguess.engine.drafters.base import Drafter
from multiguess.engine.engine import Engine
from multiguess.engine.guard import GuardedDrafter
from multiguess.engine.loaded_model import LoadedModel
from multiguess.models.loading import load_model
from multiguess.params import SamplingParams
from multiguess.remote import handshake
from multiguess.remote.client import RemoteDrafter
from multiguess.remote.hosted import Hosted
from multiguess.remote.protocol import ServerInfo, websocket_url
from multiguess.remote.server import DraftServerSettings, create_draft_app
from prometheus_client import generate_latest
from websockets.sync.client import ClientConnection, connect

from tests.servers import wait_ready

# Fixed trees: these tests need every step to draft, whatever the adaptive policy would decide.
CONFIG = EngineConfig(num_candidates=3, depth=4, max_nodes=16, max_batch=4, max_model_len=256, adaptive=False)
COOLDOWN = 0.2


class DraftServer:
    """``serve-draft``'s app under uvicorn; ``stop`` and ``start`` again keep the port. It
    serves the draft model in ``draft``, or what ``load`` loads (an EAGLE-3 head)."""

    def __init__(
        self, draft: Path, settings: DraftServerSettings, load: Callable[[], Hosted] | None = None
    ) -> None:
        self.draft, self.settings = draft, settings
        self.load = load or (lambda: host_drafter("model", DraftOptions(str(self.draft), "float32")))
        self.port = 0
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> DraftServer:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        self.app = create_draft_app(self.load, self.settings)
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            ws="websockets-sansio",
            ws_max_size=self.settings.max_frame_bytes,
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_ready(self.url)
        return self

    def stop(self) -> None:
        assert self.server is not None and self.thread is not None
        self.server.should_exit = True
        self.thread.join(10)
        assert not self.thread.is_alive(), "draft server did not stop"

    def metric(self, name: str, **labels: str) -> float:
        """A sample of the server's /metrics, read over HTTP as Prometheus would."""
        return metric_value(httpx.get(f"{self.url}/metrics").text, name, **labels)


def metric_value(text: str, name: str, **labels: str) -> float:
    """A sample's value from Prometheus text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    series = f"{name}{{{want}}}" if want else name
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def client_metric(drafter: RemoteDrafter, name: str, **labels: str) -> float:
    return metric_value(generate_latest(drafter.metrics.registry).decode(), name, **labels)


def servers_on_demand(make: Callable[..., DraftServer]) -> Iterator[Callable[..., DraftServer]]:
    """A fixture's body: ``make(**settings)`` servers started on demand, those still running
    stopped at the end of the test."""
    started: list[DraftServer] = []

    def start(**settings: object) -> DraftServer:
        server = make(**settings).start()
        started.append(server)
        return server

    yield start
    for server in started:
        if server.thread is not None and server.thread.is_alive():
            server.stop()


@pytest.fixture
def draft_server(tiny_llama_draft: Path) -> Iterator[Callable[..., DraftServer]]:
    """Starts draft servers on demand; stops those still running at the end of the test."""
    yield from servers_on_demand(
        lambda **settings: DraftServer(tiny_llama_draft, DraftServerSettings(**settings))  # type: ignore[arg-type]
    )


@pytest.fixture(scope="session")
def target(tiny_llama: Path) -> LoadedModel:
    return load_model(str(tiny_llama), dtype="float32")


def remote_engine(
    target: LoadedModel,
    url: str,
    config: EngineConfig = CONFIG,
    wrap: Callable[[Drafter], Drafter] = lambda drafter: drafter,
    **client: object,
) -> tuple[Engine, RemoteDrafter]:
    """An engine drafting through ``url`` the way ``serve --draft-url`` builds it (its guarded
    drafter in ``wrap``)."""
    options: dict = {
        "step_timeout": 2.0,
        "backoff": (0.05, 0.2),
        "target_config": target.model.config,
    } | client
    drafter = RemoteDrafter(url, target.tokenizer, **options)
    drafter.connect()  # as serve does: a head's feature layers are known before the first prompt
    guarded = GuardedDrafter(drafter, target.model.config.vocab_size, step_timeout=2.0, cooldown=COOLDOWN)
    return Engine(target, wrap(guarded), config), drafter


def add_all(engine: Engine, prompts: list[list[int]], max_tokens: int, prefix: str = "r") -> list:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [engine.add_request(f"{prefix}{i}", p, params) for i, p in enumerate(prompts)]


def finish(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def open_connection(
    url: str, secret: bytes | None = None, client: str = "test"
) -> tuple[ClientConnection, ServerInfo]:
    """A raw protocol connection, past the handshake: for tests that send their own frames."""
    conn = connect(websocket_url(url), max_size=None)
    nonce = handshake.new_nonce()
    conn.send(handshake.client_hello(client, nonce))
    challenge = handshake.parse_challenge(conn.recv(timeout=5))
    conn.send(handshake.answer(nonce, challenge.nonce, secret))
    return conn, ServerInfo.from_json(conn.recv(timeout=5))
