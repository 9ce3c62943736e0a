"""Slow and unfinished requests against a real server, over raw sockets: a request head that
trickles in, a connection that sends nothing, a body that stops short (announced or chunked)
are each answered 408 and closed within their deadline; a connection beyond the cap gets a 503;
and the server keeps answering normal requests throughout and after.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from multiguess.api.connections import ConnectionLimits
from multiguess.api.gate import BODY_TIMEOUT
from multiguess.commands import serve
from multiguess.engine.config import EngineConfig

from tests.api.conftest import LiveServer, tiny_loader

HEADER_TIMEOUT = BODY_TIMEOUT_S = 1.5
CAP = 32
SLACK = 2.0  # a loaded CI machine's scheduling delay, on top of the deadline
CHUNKED_HEAD = b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
SHORT_HEAD = (
    b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
)


@pytest.fixture(scope="module")
def guarded(start_server: Callable[..., LiveServer], tiny_llama: Path) -> LiveServer:
    config = EngineConfig(num_candidates=1, depth=1, max_nodes=1, max_batch=2, max_model_len=64)
    limits = ConnectionLimits(header_timeout=HEADER_TIMEOUT, keep_alive=5.0, max_connections=CAP)
    return start_server(tiny_loader(tiny_llama, None, config), limits=limits, body_timeout=BODY_TIMEOUT_S)


def address(live: LiveServer) -> tuple[str, int]:
    host, port = live.url.removeprefix("http://").split(":")
    return host, int(port)


@contextmanager
def connection(live: LiveServer, sent: bytes = b"") -> Iterator[socket.socket]:
    with socket.create_connection(address(live), timeout=HEADER_TIMEOUT + BODY_TIMEOUT_S + 2 * SLACK) as conn:
        if sent:
            conn.sendall(sent)
        yield conn


def answer(conn: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    while chunk := conn.recv(65536):
        received += chunk
    return received


def assert_timed_out(received: bytes, waited: float, deadline: float, code: str) -> None:
    status, _, rest = received.partition(b"\r\n")
    assert status == b"HTTP/1.1 408 Request Timeout", received
    assert f'"code": "{code}"'.encode() in rest
    assert deadline - 0.1 <= waited < deadline + SLACK, waited


def assert_serves(live: LiveServer) -> None:
    with live.client() as client:
        resp = client.post("/generate", json={"prompt": "w1 w2", "max_tokens": 2})
        assert resp.status_code == 200, resp.text


def test_the_flag_defaults_are_the_apis() -> None:
    limits = ConnectionLimits()
    assert (limits.header_timeout, limits.keep_alive) == (serve.TIMEOUT_HEADER, serve.TIMEOUT_KEEP_ALIVE)
    assert (limits.max_connections, BODY_TIMEOUT) == (serve.LIMIT_CONCURRENCY, serve.TIMEOUT_BODY)


@pytest.mark.parametrize(
    "sent",
    [b"", b"POST /generate HTTP/1.1\r\nhost: x\r\n", b"GET /health/live HTT"],
    ids=["nothing", "half-headers", "half-request-line"],
)
def test_a_request_head_that_does_not_arrive_is_408_within_the_deadline(
    guarded: LiveServer, sent: bytes
) -> None:
    started = time.monotonic()
    with connection(guarded, sent) as conn:
        received = answer(conn)
    assert_timed_out(received, time.monotonic() - started, HEADER_TIMEOUT, "header_timeout")
    assert_serves(guarded)


def test_a_head_trickling_in_byte_by_byte_is_cut_off(guarded: LiveServer) -> None:
    """Each byte arrives well within the deadline; the head as a whole does not."""
    started = time.monotonic()
    with connection(guarded) as conn:
        try:
            for byte in b"GET /health/live HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 100:
                conn.sendall(bytes([byte]))
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass
        received = answer(conn)
    assert_timed_out(received, time.monotonic() - started, HEADER_TIMEOUT, "header_timeout")


@pytest.mark.parametrize(
    "sent", [SHORT_HEAD + b'{"prompt":', CHUNKED_HEAD + b'a\r\n{"prompt":\r\n'], ids=["short", "chunked"]
)
def test_a_body_that_stops_short_is_408_within_the_deadline(guarded: LiveServer, sent: bytes) -> None:
    started = time.monotonic()
    with connection(guarded, sent) as conn:
        received = answer(conn)
    assert_timed_out(received, time.monotonic() - started, BODY_TIMEOUT_S, "body_timeout")
    assert_serves(guarded)


def test_a_kept_alive_connection_gets_the_head_deadline_again(guarded: LiveServer) -> None:
    with connection(guarded, b"GET /health/live HTTP/1.1\r\nhost: x\r\n\r\n") as conn:
        first = b""
        while not first.endswith(b'{"status":"alive"}'):  # the whole first response
            first += conn.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 OK"), first
        started = time.monotonic()
        conn.sendall(b"GET /health/live HTTP/1.1\r\n")  # the next request's head stops here
        received = answer(conn)
    assert_timed_out(received, time.monotonic() - started, HEADER_TIMEOUT, "header_timeout")


def test_slow_clients_in_numbers_are_all_closed_and_others_are_served(guarded: LiveServer) -> None:
    """A third of the cap each: slow heads, unfinished chunked bodies, short bodies. A normal
    request meanwhile is answered at once, and every slow connection is closed in time."""
    kinds = [b"POST /generate HTTP/1.1\r\nhost: x\r\n", CHUNKED_HEAD + b'5\r\n{"pro\r\n', SHORT_HEAD + b"{"]
    started = time.monotonic()
    with ExitStack() as stack:
        slow = [stack.enter_context(connection(guarded, kinds[i % 3])) for i in range(CAP - 2)]
        served = time.monotonic()
        assert_serves(guarded)
        assert time.monotonic() - served < HEADER_TIMEOUT  # before any slow one was cut off
        answers = [answer(conn) for conn in slow]
    assert time.monotonic() - started < max(HEADER_TIMEOUT, BODY_TIMEOUT_S) + SLACK
    assert all(a.startswith(b"HTTP/1.1 408 Request Timeout") for a in answers), answers


def test_a_connection_beyond_the_cap_gets_503_and_the_server_recovers(guarded: LiveServer) -> None:
    time.sleep(0.2)  # the previous tests' connections are gone
    with ExitStack() as stack:
        for _ in range(CAP):
            stack.enter_context(connection(guarded))
        with connection(guarded, b"GET /health/live HTTP/1.1\r\nhost: x\r\n\r\n") as extra:
            received = answer(extra)
    status, _, rest = received.partition(b"\r\n")
    assert status == b"HTTP/1.1 503 Service Unavailable", received
    assert b"retry-after: 1" in rest.lower() and b'"code": "too_many_connections"' in rest
    time.sleep(0.2)
    assert_serves(guarded)
