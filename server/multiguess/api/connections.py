"""Deadlines and a cap for HTTP connections, so that slow clients cannot hold the server's sockets.

uvicorn closes an idle kept-alive connection (``timeout_keep_alive``) but waits without end for
a request head that trickles in, or for a first byte that never comes. This protocol, uvicorn's
h11 one, adds two limits: the request head (request line and headers) must arrive within
``header_timeout`` seconds of the connection opening or of the previous response ending, or the
server answers 408 and closes; and a connection opened while ``max_connections`` are already
open gets a 503 for its request and is closed. The body's deadline is the request gate's
(``api/gate.py``), which reads the body. Every refusal has the API's JSON error body.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from multiguess.api.errors import error_body
from multiguess.api.gate import Receive, Refused, Scope, Send, respond


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 10.0  # seconds for a request head, from connect or the last response
    keep_alive: float = 5.0  # seconds an idle connection stays open between requests
    max_connections: int = 512  # open at once; a request on one more is a 503

    def __post_init__(self) -> None:
        if not (self.header_timeout > 0 and self.keep_alive > 0 and self.max_connections >= 1):
            raise ValueError(f"connection limits must be positive: {self}")


def refusal(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for when no request was parsed."""
    payload = json.dumps(error_body(status, message, code=code)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + payload


async def over_capacity(scope: Scope, receive: Receive, send: Send) -> None:
    """The whole app for a connection beyond the cap: 503, then the connection closes."""
    message = "the server has as many connections open as it takes (--limit-concurrency); retry"
    headers = [("connection", "close"), ("retry-after", "1")]
    await respond(send, Refused(503, message, "too_many_connections", headers), receive, 0)


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on the request head and a connection cap."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.app = over_capacity
        self.arm_header_deadline()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the head is in (or the connection is done)
            self.cancel_header_deadline()

    def on_response_complete(self) -> None:
        self.arm_header_deadline()  # before: a pipelined request's head may already be in
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_header_deadline()
        super().connection_lost(exc)

    def arm_header_deadline(self) -> None:
        self.cancel_header_deadline()
        self.header_timer = self.loop.call_later(self.limits.header_timeout, self.header_timed_out)

    def cancel_header_deadline(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def header_timed_out(self) -> None:
        self.header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        timeout = f"{self.limits.header_timeout:g}"
        message = f"the request head did not arrive within {timeout} s (--timeout-header)"
        self.transport.write(refusal(408, "Request Timeout", message, "header_timeout"))
        self.transport.close()


def server_config(app: Any, limits: ConnectionLimits | None = None, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration for ``app`` with these limits (``options``: uvicorn's own)."""
    limits = limits or ConnectionLimits()
    protocol = type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": limits})
    return uvicorn.Config(app, http=protocol, timeout_keep_alive=limits.keep_alive, **options)  # type: ignore[arg-type]
