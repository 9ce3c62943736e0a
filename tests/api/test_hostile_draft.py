"""A draft server that answers with trees the target must not verify only costs speed.

The target is built exactly as ``multiguess serve --draft-url`` builds it and warms up
against the hostile server: warm-up succeeds, liveness stays 200, readiness says "degraded"
with the reason, every request succeeds with the target's own output, and the fallback
counter counts the steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from multiguess.cli import build_parser
from multiguess.commands.serve import build_engine
from multiguess.models.loading import load_model
from multiguess.remote.protocol import ServerInfo, tokenizer_fingerprint

from tests.api.conftest import LiveServer
from tests.api.helpers import metric
from tests.api.hostile_draft import BAD_TREES, HostileDraftServer
from tests.engine.test_lossless import reference
from tests.servers import wait_ready

PROMPT = [5, 9, 11, 13, 17]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def expected(tiny_llama: Path) -> list[int]:
    return reference(tiny_llama, [PROMPT], MAX_TOKENS, ignore_eos=True)[0]


@pytest.fixture
def hostile(tiny_llama: Path) -> Iterator[Callable[[str], HostileDraftServer]]:
    target = load_model(str(tiny_llama), dtype="float32")
    info = ServerInfo(
        "hostile", tokenizer_fingerprint(target.tokenizer), target.model.config.vocab_size, 256, 8
    )
    started: list[HostileDraftServer] = []

    def start(mode: str) -> HostileDraftServer:
        server = HostileDraftServer(info, mode)
        started.append(server)
        wait_ready(server.url)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.mark.parametrize("mode", list(BAD_TREES))
def test_a_hostile_draft_server_costs_speed_never_requests(
    mode: str,
    hostile: Callable[[str], HostileDraftServer],
    start_server: Callable[..., LiveServer],
    tiny_llama: Path,
    expected: list[int],
) -> None:
    draft = hostile(mode)
    argv = ["serve", "--target", str(tiny_llama), "--draft-url", draft.url, "--dtype", "float32",
            "--device", "cpu", "--max-model-len", "256", "--no-adaptive", "--draft-cooldown", "0"]  # fmt: skip
    args = build_parser().parse_args(argv)
    live = start_server(lambda: build_engine(args))  # warms up against the hostile server
    with live.client() as client:
        assert client.get("/health/live").status_code == 200
        ready = client.get("/health/ready")
        assert ready.status_code == 200 and ready.json()["status"] == "degraded"
        assert "invalid draft" in ready.json()["reason"]
        body = {
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
        }
        reply = client.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == MAX_TOKENS
        # Every step but the last (no room left to draft) asked the draft server and fell back.
        assert metric(client, "multiguess_spec_fallback_steps_total") == MAX_TOKENS - 1
        assert metric(client, "multiguess_spec_draft_tokens_total") == 0
    assert reply.json()["choices"][0]["text"] == live.engine.tokenizer.decode(expected)
