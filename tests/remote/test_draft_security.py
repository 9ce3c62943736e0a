"""The draft protocol against hostile peers: real draft servers on 127.0.0.1, raw WebSockets.

A client without the deployment's secret is refused, a connection reaches only its own
sessions, a bad frame fails only its own request, one connection cannot evict everybody's
sessions, and the hello names the model without its path.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from multiguess.engine.drafter import TreeBudget
from multiguess.engine.loaded_model import LoadedModel
from multiguess.remote import handshake
from multiguess.remote.client import RemoteDrafter
from multiguess.remote.handshake import AuthenticationFailed
from multiguess.remote.protocol import (
    Drafted,
    Failed,
    Request,
    Resend,
    StepMessage,
    StepReply,
    decode_reply,
    encode_step,
    websocket_url,
)
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tests.remote.conftest import DraftServer, add_all, client_metric, finish, open_connection, remote_engine

SECRET = b"per-deployment secret"
BUDGET = TreeBudget(2, 2, 4)


def step(conn: ClientConnection, info_vocab: int, *requests: Request) -> StepReply:
    conn.send(encode_step(StepMessage(requests=requests)))
    return decode_reply(conn.recv(timeout=10), info_vocab)


def test_a_server_with_a_secret_refuses_clients_without_it(
    draft_server: Callable[..., DraftServer], target: LoadedModel
) -> None:
    server = draft_server(secret=SECRET)
    for wrong in (None, b"guessed"):
        with pytest.raises(ConnectionClosed) as closed:
            conn, _ = open_connection(server.url, secret=wrong)
            conn.recv(timeout=5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    assert server.metric("multiguess_draft_auth_failures_total") == 2
    # The target's drafter says why, counts it, and its requests decode alone.
    engine, drafter = remote_engine(target, server.url)
    (seq,) = add_all(engine, [[5, 9, 11]], 8)
    finish(engine)
    assert len(seq.output_ids) == 8 and seq.stats.draft_tokens == 0
    assert client_metric(drafter, "multiguess_remote_draft_failures_total", kind="auth") >= 1
    assert "requires the draft secret" in (engine.drafter.reason or "")  # type: ignore[union-attr]


def test_with_the_secret_the_target_drafts(
    draft_server: Callable[..., DraftServer], target: LoadedModel
) -> None:
    server = draft_server(secret=SECRET)
    engine, _ = remote_engine(target, server.url, secret=SECRET)
    (seq,) = add_all(engine, [[5, 9, 11]], 12)
    finish(engine)
    assert seq.stats.draft_tokens > 0 and seq.stats.fallback_steps == 0


def test_a_client_with_a_secret_refuses_a_server_that_cannot_prove_it(
    draft_server: Callable[..., DraftServer], target: LoadedModel
) -> None:
    server = draft_server()  # a rogue or misconfigured server: no secret
    drafter = RemoteDrafter(server.url, target.tokenizer, secret=SECRET)
    with pytest.raises(AuthenticationFailed, match="did not prove"):
        drafter._connection(deadline=drafter.clock() + 5)


def test_the_handshake_has_a_deadline(draft_server: Callable[..., DraftServer]) -> None:
    server = draft_server(handshake_timeout=0.3)
    with connect(websocket_url(server.url)) as conn, pytest.raises(ConnectionClosed) as closed:
        conn.recv(timeout=5)  # say nothing
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


def test_the_hello_names_the_model_without_its_path(
    draft_server: Callable[..., DraftServer], tiny_llama_draft: Path
) -> None:
    server = draft_server()
    conn = connect(websocket_url(server.url))
    with conn:
        nonce = handshake.new_nonce()
        conn.send(handshake.client_hello("curious", nonce))
        challenge = handshake.parse_challenge(conn.recv(timeout=5))
        conn.send(handshake.answer(nonce, challenge.nonce, None))
        hello = conn.recv(timeout=5)
    assert isinstance(hello, str)
    assert str(tiny_llama_draft.parent) not in hello and '"model": "llama-draft"' in hello


def test_a_second_connection_with_the_same_client_id_cannot_read_a_session(
    draft_server: Callable[..., DraftServer],
) -> None:
    server = draft_server()
    first, info = open_connection(server.url, client="pod-a")
    second, _ = open_connection(server.url, client="pod-a")
    with first, second:
        prompt = (5, 9, 11, 13)
        (mine,) = step(first, info.vocab_size, Request(0, 0, prompt, BUDGET)).results
        assert isinstance(mine, Drafted)
        # The second connection claims to continue slot 0: the server holds nothing for it.
        (theirs,) = step(second, info.vocab_size, Request(0, len(prompt), (17,), BUDGET)).results
        assert theirs == Resend(0)
        (again,) = step(first, info.vocab_size, Request(0, len(prompt), (17,), BUDGET)).results
        assert isinstance(again, Drafted)


def test_a_bad_request_fails_alone_and_the_connection_stays(draft_server: Callable[..., DraftServer]) -> None:
    server = draft_server()
    bad, info = open_connection(server.url, client="fuzzer")
    good, _ = open_connection(server.url, client="target")
    with bad, good:
        results = step(
            bad,
            info.vocab_size,
            Request(0, 0, (5, 9), TreeBudget(2, 0, 4)),  # depth 0: nothing to draft
            Request(1, 0, (5, info.vocab_size + 7), BUDGET),
            Request(2, 0, (5, 9), BUDGET),
        ).results
        assert isinstance(results[0], Failed) and "depth" in results[0].reason
        assert isinstance(results[1], Failed) and "vocabulary" in results[1].reason
        assert isinstance(results[2], Drafted)
        (other,) = step(good, info.vocab_size, Request(0, 0, (5, 9, 11), BUDGET)).results
        assert isinstance(other, Drafted)


def test_one_connection_cannot_evict_everyone_elses_sessions(
    draft_server: Callable[..., DraftServer],
) -> None:
    server = draft_server(max_sessions=4, max_client_sessions=2)
    victim, info = open_connection(server.url, client="target")
    flood, _ = open_connection(server.url, client="flood")
    with victim, flood:
        prompt = (5, 9, 11)
        assert isinstance(step(victim, info.vocab_size, Request(0, 0, prompt, BUDGET)).results[0], Drafted)
        for slot in range(10):  # far more sessions than the table holds
            (result,) = step(flood, info.vocab_size, Request(slot, 0, (7, 8, slot + 1), BUDGET)).results
            assert isinstance(result, Drafted)
        assert server.metric("multiguess_draft_sessions") == 3
        # The victim's session survived: it continues without a resend.
        (kept,) = step(victim, info.vocab_size, Request(0, len(prompt), (13,), BUDGET)).results
        assert isinstance(kept, Drafted)
        # All at once in one message: past its limit a connection is refused, not served by evicting.
        many = [Request(100 + i, 0, (7, 8), BUDGET) for i in range(3)]
        results = step(flood, info.vocab_size, *many).results
        assert sum(isinstance(r, Failed) and "limit of 2" in r.reason for r in results) == 1


def test_a_closed_connection_frees_its_sessions(draft_server: Callable[..., DraftServer]) -> None:
    server = draft_server()
    conn, info = open_connection(server.url)
    with conn:
        step(conn, info.vocab_size, Request(0, 0, (5, 9), BUDGET), Request(1, 0, (5, 10), BUDGET))
        assert server.metric("multiguess_draft_sessions") == 2
    probe, _ = open_connection(server.url)  # the close is handled before this one's first step
    with probe:
        step(probe, info.vocab_size, Request(0, 0, (5, 9), BUDGET))
        assert server.metric("multiguess_draft_sessions") == 1
