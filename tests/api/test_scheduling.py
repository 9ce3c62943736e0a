"""Concurrency, backpressure (429), deadlines (504 / error event) and client disconnects."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from multiguess.api import ServerSettings, create_app
from multiguess.engine.config import EngineConfig
from multiguess.engine.engine import Engine
from multiguess.errors import ModelLoadError

from tests.api.conftest import LiveServer, tiny_loader
from tests.api.faults import Faults
from tests.api.helpers import metric, sse_events

LONG = {"prompt": "w3 w4", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


def test_parallel_greedy_requests_equal_sequential_ones(server: LiveServer) -> None:
    prompts = [" ".join(f"w{(i * 7 + j) % 60}" for j in range(2 + i % 5)) for i in range(16)]

    def body(prompt: str) -> dict:
        return {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    with server.client() as client:
        sequential = [
            client.post("/v1/completions", json=body(p)).json()["choices"][0]["text"] for p in prompts
        ]

    async def all_at_once() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            resps = await asyncio.gather(*(client.post("/v1/completions", json=body(p)) for p in prompts))
        return [r.json()["choices"][0]["text"] for r in resps]

    assert asyncio.run(all_at_once()) == sequential
    assert len(set(sequential)) > 1


def wait_idle(live: LiveServer, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while live.engine.has_unfinished() or live.scheduler._in_flight:
        assert time.monotonic() < deadline, "the engine still has work: a request leaked"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def narrow(start_server: Callable[..., LiveServer], tiny_llama: Path, tiny_llama_draft: Path) -> LiveServer:
    """One batch slot, one waiting place, a 1 s deadline, and steps of at least 20 ms (at most
    two tokens each), so that LONG takes seconds on any machine. Not adaptive: every step drafts."""
    config = EngineConfig(
        num_candidates=1, depth=1, max_nodes=1, max_batch=1, max_model_len=512, adaptive=False
    )
    faults = Faults(delay=0.02)
    load = tiny_loader(tiny_llama, tiny_llama_draft, config, faults=faults)
    return start_server(load, max_queue=1, request_timeout=1.0)


def test_health_and_metrics_answer_while_generating(narrow: LiveServer) -> None:
    """The event loop never waits on the engine: mid-generation, health and metrics answer and
    the running gauge shows the request."""
    with (
        narrow.client() as client,
        client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as resp,
    ):
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        with narrow.client() as other:
            assert other.get("/health/ready", timeout=2).status_code == 200
            assert metric(other, "multiguess_requests_running") == 1
        list(lines)
    wait_idle(narrow)


def test_full_queue_gets_429_with_retry_after(narrow: LiveServer) -> None:
    with narrow.client() as client:
        rejected = metric(client, "multiguess_requests_rejected_total", reason="queue_full")
        with (
            client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as running,
            narrow.client() as second,
            second.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as waiting,
        ):
            assert running.status_code == waiting.status_code == 200  # both admitted
            resp = client.post("/v1/completions", json=LONG)
            assert resp.status_code == 429
            assert int(resp.headers["retry-after"]) >= 1
            assert resp.json()["error"]["type"] == "rate_limit_error"
        assert metric(client, "multiguess_requests_rejected_total", reason="queue_full") == rejected + 1
    wait_idle(narrow)


def test_deadline_gives_504_and_frees_the_engine(narrow: LiveServer) -> None:
    with narrow.client() as client:
        started = time.monotonic()
        resp = client.post("/v1/completions", json=LONG)
        assert resp.status_code == 504
        assert time.monotonic() - started < 5
        assert "timeout" in resp.json()["error"]["message"]
    wait_idle(narrow)


def test_deadline_while_streaming_sends_an_error_event_and_closes(narrow: LiveServer) -> None:
    with (
        narrow.client() as client,
        client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as resp,
    ):
        events = sse_events(list(resp.iter_lines()))
    assert "[DONE]" not in events
    assert events[-1]["error"]["code"] == "request_timeout"
    assert any("choices" in e for e in events[:-1])  # it was generating before the deadline
    wait_idle(narrow)


def test_stream_disconnect_stops_generation(narrow: LiveServer) -> None:
    with narrow.client() as client:
        generated = metric(client, "multiguess_generation_tokens_total")
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as resp:
            assert next(line for line in resp.iter_lines() if line.startswith("data: "))
        wait_idle(narrow, timeout=2)
        assert metric(client, "multiguess_generation_tokens_total") - generated < LONG["max_tokens"]


def test_non_streaming_disconnect_stops_generation(narrow: LiveServer) -> None:
    with narrow.client() as client:
        generated = metric(client, "multiguess_generation_tokens_total")
    with narrow.client() as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json=LONG, timeout=0.3)
    wait_idle(narrow, timeout=2)
    with narrow.client() as client:
        assert metric(client, "multiguess_generation_tokens_total") - generated < LONG["max_tokens"]


def test_draining_refuses_new_work_and_fails_readiness(
    start_server: Callable[..., LiveServer], tiny_llama: Path, tiny_config: EngineConfig
) -> None:
    live = start_server(tiny_loader(tiny_llama, None, tiny_config))
    live.scheduler.drain()  # what SIGTERM does first
    with live.client() as client:
        ready = client.get("/health/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        resp = client.post("/v1/completions", json={"prompt": "w1", "max_tokens": 2})
        assert resp.status_code == 503 and "shutting down" in resp.json()["error"]["message"]
        assert metric(client, "multiguess_requests_rejected_total", reason="not_ready") == 1


def test_a_failed_load_fails_readiness_and_liveness(tmp_path: Path) -> None:
    def load() -> Engine:
        raise ModelLoadError(f"cannot load model {str(tmp_path)!r}: no config.json")

    app = create_app(load, ServerSettings(model_name="broken"))
    with TestClient(app) as client:
        deadline = time.monotonic() + 10
        while app.state.scheduler.state == "loading" and time.monotonic() < deadline:
            time.sleep(0.01)
        ready, live = client.get("/health/ready"), client.get("/health/live")
        assert ready.status_code == live.status_code == 503
        assert "no config.json" in ready.json()["reason"] and live.json()["status"] == "failed"
        assert client.post("/generate", json={"prompt": "w1"}).status_code == 503
