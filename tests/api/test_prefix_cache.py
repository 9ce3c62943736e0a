"""Prefix caching as a server shows it: the counters of prompt tokens looked up and served from
the cache, over real HTTP, and the vLLM-spelled switch with its environment variable."""

from __future__ import annotations

import pytest
from multiguess.cli import build_parser

from tests.api.conftest import LiveServer
from tests.api.helpers import metric

SYSTEM = " ".join(f"w{i % 50 + 4}" for i in range(60))  # a long shared system prompt


def test_a_shared_prompt_is_served_from_the_cache_and_counted(server: LiveServer) -> None:
    names = ("multiguess_prefix_cache_queried_tokens_total", "multiguess_prefix_cache_hit_tokens_total")
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with server.client() as client:
        before = [metric(client, name) for name in names]
        first = client.post("/v1/completions", json={"prompt": SYSTEM + " w1 w2", **body})
        middle = [metric(client, name) for name in names]
        second = client.post("/v1/completions", json={"prompt": SYSTEM + " w3 w5 w7", **body})
        after = [metric(client, name) for name in names]
    assert first.status_code == second.status_code == 200
    tokens = [r.json()["usage"]["prompt_tokens"] for r in (first, second)]
    assert middle[0] - before[0] == tokens[0] and after[0] - middle[0] == tokens[1]
    # the second request's system prompt came from the first one's kept slot
    assert after[1] - middle[1] >= 60
    # and its usage says so, as OpenAI's prompt_tokens_details does
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, second)]
    assert cached[1] == after[1] - middle[1] and cached[0] == middle[1] - before[1]


def parse(*argv: str) -> object:
    return build_parser().parse_args(["serve", *argv])


def test_the_switch_is_on_by_default_and_the_environment_can_turn_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert parse().enable_prefix_caching is True
    assert parse("--no-enable-prefix-caching").enable_prefix_caching is False
    monkeypatch.setenv("MULTIGUESS_ENABLE_PREFIX_CACHING", "0")
    assert parse().enable_prefix_caching is False
    assert parse("--enable-prefix-caching").enable_prefix_caching is True
