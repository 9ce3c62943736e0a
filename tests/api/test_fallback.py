"""Fallback: a failing or slow drafter never changes output; readiness degrades and recovers."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from multiguess.engine.config import EngineConfig

from tests.api.conftest import LiveServer, tiny_loader
from tests.api.faults import Faults
from tests.api.helpers import metric

BODY = {"prompt": "w11 w12 w13", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
COOLDOWN = 0.5  # tiny_loader's guard


@pytest.fixture(scope="module")
def faulty(
    start_server: Callable[..., LiveServer],
    tiny_llama: Path,
    tiny_llama_draft: Path,
    tiny_config: EngineConfig,
) -> tuple[LiveServer, Faults]:
    faults = Faults()
    load = tiny_loader(tiny_llama, tiny_llama_draft, tiny_config, faults=faults)
    return start_server(load, request_timeout=60), faults


@pytest.fixture
def client(faulty: tuple[LiveServer, Faults]) -> Iterator[httpx.Client]:
    with faulty[0].client() as c:
        yield c


def generate(client: httpx.Client) -> tuple[str, dict]:
    body = client.post("/v1/completions", json=BODY).json()
    return body["choices"][0]["text"], body["multiguess"]


def recover(client: httpx.Client, faults: Faults) -> None:
    """Clear the fault; once the cool-down (and an abandoned slow call) is over, a request
    drafts again and readiness is back to plain "ready"."""
    faults.fail, faults.lag = False, 0.0
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        time.sleep(COOLDOWN)
        generate(client)
        if client.get("/health/ready").json() == {"status": "ready"}:
            return
    pytest.fail("readiness did not recover after the fault was cleared")


@pytest.mark.parametrize(
    ("fault", "reason"),
    [({"fail": True}, "injected draft failure"), ({"lag": 60.0}, "longer than")],
    ids=["raises", "too-slow"],
)
def test_output_unchanged_counter_moves_readiness_degrades_then_recovers(
    faulty: tuple[LiveServer, Faults], client: httpx.Client, fault: dict, reason: str
) -> None:
    _, faults = faulty
    healthy_text, healthy_stats = generate(client)
    assert healthy_stats["fallback_steps"] == 0 and healthy_stats["draft_tokens"] > 0
    fallbacks = metric(client, "multiguess_spec_fallback_steps_total")

    for key, value in fault.items():
        setattr(faults, key, value)
    text, stats = generate(client)
    assert text == healthy_text
    assert stats["fallback_steps"] >= 1
    assert metric(client, "multiguess_spec_fallback_steps_total") >= fallbacks + stats["fallback_steps"]
    ready = client.get("/health/ready")
    assert ready.status_code == 200  # degraded pods stay in service: the target alone is exact
    assert ready.json()["status"] == "degraded" and reason in ready.json()["reason"]

    proposals = faults.proposals
    recover(client, faults)
    assert faults.proposals > proposals  # speculation resumed
    assert generate(client)[0] == healthy_text
