"""Remote drafting end to end: real draft servers on 127.0.0.1, real WebSocket connections.

The truth is transformers' own greedy decoding of the target: whatever the draft server
does (serve, die, come back, evict), the output must equal it token for token.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from multiguess.engine.drafter import DraftRequest, TreeBudget
from multiguess.engine.loaded_model import LoadedModel
from multiguess.engine.paged_kv import PagedKVCache
from multiguess.errors import IncompatibleDraftError
from multiguess.params import SamplingParams
from multiguess.remote.client import RemoteDrafter, RemoteDraftError
from websockets.exceptions import ConnectionClosed

from tests.engine.test_lossless import random_prompts, reference
from tests.remote.conftest import (
    CONFIG,
    COOLDOWN,
    DraftServer,
    add_all,
    client_metric,
    finish,
    metric_value,
    open_connection,
    remote_engine,
)
from tests.servers import wait_ready
from tests.tiny_models import WORDS, build_tokenizer

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def truth(tiny_llama: Path) -> Callable[[int, tuple[int, ...]], tuple[list[list[int]], list[list[int]]]]:
    cache: dict = {}

    def get(seed: int, lengths: tuple[int, ...]) -> tuple[list[list[int]], list[list[int]]]:
        if (seed, lengths) not in cache:
            prompts = random_prompts(seed, lengths)
            cache[seed, lengths] = (prompts, reference(tiny_llama, prompts, MAX_TOKENS, ignore_eos=True))
        return cache[seed, lengths]

    return get


def test_remote_greedy_output_equals_the_target_alone(
    draft_server: Callable[..., DraftServer], target: LoadedModel, truth: Callable
) -> None:
    server = draft_server()
    prompts, expected = truth(1, (1, 6, 31))
    engine, drafter = remote_engine(target, server.url)
    seqs = add_all(engine, prompts, MAX_TOKENS)
    finish(engine)
    assert [s.output_ids for s in seqs] == expected
    assert engine.totals.fallback_steps == 0
    assert engine.totals.accepted_tokens > 0
    # one round trip per drafting step, all on one connection
    steps = client_metric(drafter, "multiguess_remote_draft_round_trip_seconds_count")
    assert 0 < steps <= engine.totals.verify_steps
    assert client_metric(drafter, "multiguess_remote_draft_connects_total") == 1
    assert server.metric("multiguess_draft_requests_total") > 0
    # every commit was valid and every session stayed: nothing had to be sent twice
    assert client_metric(drafter, "multiguess_remote_draft_resends_total") == 0


def test_remote_greedy_over_a_paged_target_cache(
    draft_server: Callable[..., DraftServer], target: LoadedModel, truth: Callable
) -> None:
    """The torch backend keeps the target's KV in blocks: a remote draft's trees verified over
    them, and prompts sent again starting from shared blocks, decode the target's own tokens."""
    server = draft_server()
    prompts, expected = truth(1, (1, 6, 31))
    engine, _ = remote_engine(target, server.url, replace(CONFIG, backend="torch"))
    assert isinstance(engine.target.cache, PagedKVCache)
    seqs = add_all(engine, prompts, MAX_TOKENS)
    finish(engine)
    again = add_all(engine, prompts, MAX_TOKENS, prefix="again")
    finish(engine)
    assert [s.output_ids for s in seqs] == expected == [s.output_ids for s in again]
    assert engine.totals.accepted_tokens > 0 and engine.totals.fallback_steps == 0
    assert sum(s.cached_tokens for s in again) > 0


def test_seeded_sampling_through_the_server_is_reproducible(
    draft_server: Callable[..., DraftServer], target: LoadedModel
) -> None:
    server = draft_server()
    engine, _ = remote_engine(target, server.url)
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    outs = []
    for run in range(2):
        seq = engine.add_request(f"s{run}", [5, 9, 11, 40], params)
        finish(engine)
        outs.append(seq.output_ids)
    assert outs[0] == outs[1] and len(outs[0]) == 24
    assert engine.totals.draft_tokens > 0 and engine.totals.fallback_steps == 0


def test_killed_draft_server_falls_back_then_drafts_again(
    draft_server: Callable[..., DraftServer], target: LoadedModel, truth: Callable
) -> None:
    server = draft_server()
    prompts, expected = truth(2, (3, 17, 40))
    engine, _ = remote_engine(target, server.url)
    seqs = add_all(engine, prompts, MAX_TOKENS)
    for _ in range(3):
        engine.step()
    assert engine.totals.draft_tokens > 0 and engine.totals.fallback_steps == 0
    server.stop()
    for _ in range(3):
        engine.step()
    assert engine.totals.fallback_steps > 0
    assert engine.drafter.degraded  # type: ignore[union-attr]
    server.start()
    time.sleep(COOLDOWN + 0.25)  # the guard's pause and the client's backoff
    drafted_before = engine.totals.draft_tokens
    finish(engine)
    assert [s.output_ids for s in seqs] == expected
    assert engine.totals.draft_tokens > drafted_before, "the restarted server was not used again"
    assert not engine.drafter.degraded  # type: ignore[union-attr]


def test_one_draft_server_serves_two_targets_through_evictions(
    draft_server: Callable[..., DraftServer], target: LoadedModel, truth: Callable
) -> None:
    """Three slots for four sequences of two target servers: sessions are evicted and re-sent."""
    server = draft_server(max_sessions=3)
    prompts, expected = truth(3, (2, 9, 14, 25))
    (engine_a, client_a), (engine_b, client_b) = (
        remote_engine(target, server.url),
        remote_engine(target, server.url),
    )
    seqs = add_all(engine_a, prompts[:2], MAX_TOKENS, "a") + add_all(engine_b, prompts[2:], MAX_TOKENS, "b")
    while engine_a.has_unfinished() or engine_b.has_unfinished():
        engine_a.step()
        engine_b.step()
    assert [s.output_ids for s in seqs] == expected
    assert server.metric("multiguess_draft_session_evictions_total", reason="lru") > 0
    resends = [client_metric(c, "multiguess_remote_draft_resends_total") for c in (client_a, client_b)]
    assert sum(resends) > 0
    assert engine_a.totals.fallback_steps == engine_b.totals.fallback_steps == 0


def test_idle_sessions_are_evicted_and_resent(
    draft_server: Callable[..., DraftServer], target: LoadedModel, truth: Callable
) -> None:
    server = draft_server(idle_seconds=0.2)
    prompts, expected = truth(4, (5,))
    engine, drafter = remote_engine(target, server.url)
    (seq,) = add_all(engine, prompts, MAX_TOKENS)
    engine.step()
    time.sleep(0.4)
    finish(engine)
    assert seq.output_ids == expected[0]
    assert server.metric("multiguess_draft_session_evictions_total", reason="idle") == 1
    assert client_metric(drafter, "multiguess_remote_draft_resends_total") == 1


def test_a_draft_with_another_tokenizer_is_refused(
    draft_server: Callable[..., DraftServer], target: LoadedModel
) -> None:
    server = draft_server()
    other = build_tokenizer([*WORDS[:-1], "different"])
    drafter = RemoteDrafter(server.url, other)
    with pytest.raises(IncompatibleDraftError, match="different tokenizer"):
        drafter.propose([DraftRequest(0, [5, 9], TreeBudget())])


def test_a_silent_server_costs_one_deadline_then_backs_off(target: LoadedModel) -> None:
    """A peer that accepts TCP but never answers: the step fails at its deadline, not later."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        drafter = RemoteDrafter(url, target.tokenizer, step_timeout=0.3, backoff=(5.0, 10.0))
        started = time.monotonic()
        with pytest.raises(RemoteDraftError, match=r"within 0\.3 s"):
            drafter.propose([DraftRequest(0, [5, 9], TreeBudget())])
        assert time.monotonic() - started < 1.5
        with pytest.raises(RemoteDraftError, match="reconnecting"):
            drafter.propose([DraftRequest(0, [5, 9], TreeBudget())])
        assert client_metric(drafter, "multiguess_remote_draft_failures_total", kind="timeout") == 1


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow  # two real processes importing torch: ~15 s on an idle machine, ~50 s on a busy one
def test_serve_draft_and_serve_as_the_operator_runs_them(
    tiny_llama: Path, tiny_llama_draft: Path, truth: Callable, tmp_path: Path
) -> None:
    """Both commands as real processes, configured by the operator's environment variables
    (``placement: separate``, the deployment's draft secret mounted as a file in both pools):
    exact output, drafted remotely, both sides' metrics."""
    draft_port, target_port = free_port(), free_port()
    secret = tmp_path / "draft-secret"
    secret.write_text("generated-per-deployment\n")
    common = {
        "MULTIGUESS_DRAFT_SECRET_FILE": str(secret),
        "MULTIGUESS_DTYPE": "float32",
        "MULTIGUESS_HOST": "127.0.0.1",
        "MULTIGUESS_LOG_LEVEL": "warning",
    }
    draft_env = common | {"MULTIGUESS_DRAFT": str(tiny_llama_draft), "MULTIGUESS_PORT": str(draft_port)}
    target_env = common | {
        "MULTIGUESS_TARGET": str(tiny_llama),
        "MULTIGUESS_DRAFT": "/nonexistent/never-loaded-locally",
        "MULTIGUESS_DRAFT_URL": f"http://127.0.0.1:{draft_port}",
        "MULTIGUESS_PORT": str(target_port),
        "MULTIGUESS_MAX_MODEL_LEN": "256",
        "MULTIGUESS_DRAFT_COOLDOWN": "0.5",  # it may warm up before the draft server is ready
    }
    cli = [sys.executable, "-m", "multiguess.cli"]
    processes = [
        subprocess.Popen([*cli, "serve-draft"], env=os.environ | draft_env),
        subprocess.Popen([*cli, "serve"], env=os.environ | target_env),
    ]
    draft_url, url = f"http://127.0.0.1:{draft_port}", f"http://127.0.0.1:{target_port}"
    try:
        wait_ready(draft_url, timeout=120, process=processes[0])
        wait_ready(url, timeout=120, process=processes[1])
        prompts, expected = truth(5, (8,))
        body = {"prompt": prompts[0], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        deadline = time.monotonic() + 30
        while True:  # every reply is exact; once the pause is over, one is drafted remotely
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
            assert reply["choices"][0]["text"].split() == [WORDS[t - 4] for t in expected[0]]
            if reply["multiguess"]["draft_tokens"] > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert reply["multiguess"]["draft_tokens"] > 0
        metrics = httpx.get(f"{url}/metrics").text
        assert metric_value(metrics, "multiguess_remote_draft_round_trip_seconds_count") > 0
        draft_metrics = httpx.get(f"{draft_url}/metrics").text
        assert metric_value(draft_metrics, "multiguess_draft_requests_total") > 0
        assert metric_value(draft_metrics, "multiguess_draft_connections") == 1
        assert metric_value(draft_metrics, "multiguess_draft_auth_failures_total") == 0
    finally:
        for process in processes:
            process.terminate()
        assert [p.wait(30) for p in processes] == [0, 0]


def test_sequences_too_long_for_the_draft_server_decode_alone(
    draft_server: Callable[..., DraftServer], target: LoadedModel, truth: Callable
) -> None:
    """The server refuses one sequence (its cache is too short); the other still drafts."""
    server = draft_server(max_model_len=40)
    prompts, expected = truth(6, (4, 45))
    engine, drafter = remote_engine(target, server.url)
    short, long = add_all(engine, prompts, MAX_TOKENS)
    finish(engine)
    assert [short.output_ids, long.output_ids] == expected
    assert long.stats.draft_tokens == 0 and short.stats.draft_tokens > 0
    assert client_metric(drafter, "multiguess_remote_draft_refused_total") > 0


def test_a_malformed_frame_closes_the_connection_with_a_protocol_error(
    draft_server: Callable[..., DraftServer],
) -> None:
    server = draft_server()
    conn, _ = open_connection(server.url)
    with conn:
        conn.send(b"\x01\x01garbage")
        with pytest.raises(ConnectionClosed) as closed:
            conn.recv(timeout=5)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1002
    assert "truncated" in closed.value.rcvd.reason
