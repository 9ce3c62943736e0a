"""``RemoteDrafter``: the target side of remote drafting, used exactly like ``ModelDrafter``.

Each engine step is one round trip on one persistent WebSocket. Only what the draft server
lacks travels: per sequence, the tokens emitted since the last step (the accepted path is
sent along, so the server keeps those tokens' draft KV). Commits and releases ride on the
next step's message instead of costing round trips of their own.

Failures raise, within the per-step deadline, so the engine decodes that step with the target
alone; wrap this drafter in ``GuardedDrafter`` for the cool-down and readiness. The
connection is re-opened on the next step after a failure, with exponential backoff between
failed attempts. Output never depends on the server: the target verifies every tree, and
``GuardedDrafter`` checks every proposal before the target sees it. With ``secret`` set, the
handshake proves both sides hold it (``handshake``); a server that cannot is refused.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable

import torch
from prometheus_client import CollectorRegistry
from transformers import PreTrainedTokenizerBase
from websockets.exceptions import WebSocketException
from websockets.sync.client import ClientConnection, connect

from multiguess.engine.acceptance import Acceptance
from multiguess.engine.drafter import DraftRequest, Proposal
from multiguess.engine.tree import TokenTree
from multiguess.errors import IncompatibleDraftError
from multiguess.remote import handshake
from multiguess.remote.handshake import AuthenticationFailed
from multiguess.remote.metrics import ClientMetrics
from multiguess.remote.protocol import (
    Commit,
    Drafted,
    Failed,
    ProtocolError,
    Request,
    Resend,
    Sampling,
    ServerInfo,
    StepMessage,
    decode_reply,
    encode_step,
    tokenizer_fingerprint,
    websocket_url,
)

log = logging.getLogger(__name__)


class RemoteDraftError(RuntimeError):
    """The draft server did not deliver this step (its message says why)."""


class DraftTimeout(RemoteDraftError):
    """The draft server did not answer within the step's time."""

    fallback_reason = "timeout"


class ServerRefused(RemoteDraftError):
    """The server answered, but drafted none of the step's requests."""

    fallback_reason = "refused"


def wire_request(req: DraftRequest, start: int, sampling: Sampling | None) -> Request:
    """``req`` for a server holding ``start`` of its tokens (at least the root is sent)."""
    start = min(max(start, 0), len(req.token_ids) - 1)
    return Request(req.slot, start, tuple(req.token_ids[start:]), req.budget, sampling)


def default_client_id() -> str:
    """Unique per target server process: its sessions on a shared draft server never collide."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class RemoteDrafter:
    def __init__(
        self,
        url: str,
        tokenizer: PreTrainedTokenizerBase | None = None,
        step_timeout: float = 2.0,
        connect_timeout: float = 2.0,
        backoff: tuple[float, float] = (0.5, 30.0),
        registry: CollectorRegistry | None = None,
        client_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        secret: bytes | None = None,
    ) -> None:
        """``tokenizer`` is the target's: the server's must match it (checked on connect).
        ``secret`` is the deployment's draft secret (``--draft-secret``), if it has one."""
        if step_timeout <= 0 or connect_timeout <= 0 or not 0 < backoff[0] <= backoff[1]:
            raise ValueError("timeouts must be > 0 and backoff (first, max) with 0 < first <= max")
        self.url = websocket_url(url)
        self.fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
        self.step_timeout = step_timeout
        self.connect_timeout = connect_timeout
        self.backoff = backoff
        self.client_id = client_id or default_client_id()
        self.secret = secret
        self.clock = clock
        self.metrics = ClientMetrics(registry or CollectorRegistry())
        self.info: ServerInfo | None = None
        # The last successful step: (round trip, the server's own compute), in seconds.
        self.last_timing: tuple[float, float] = (0.0, 0.0)
        self._server_seconds = 0.0
        self._conn: ClientConnection | None = None
        self._next_attempt = 0.0
        self._delay = backoff[0]
        self._sent: dict[int, int] = {}  # slot -> sequence length at its last request
        self._commits: dict[int, tuple[int, ...]] = {}  # accepted paths not sent yet
        self._releases: set[int] = set()

    # -- the Drafter interface ---------------------------------------------------------------
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        started = self.clock()
        if self._conn is None and started < self._next_attempt:
            raise RemoteDraftError(
                f"reconnecting to the draft server in {self._next_attempt - started:.1f} s"
            )
        deadline = started + self.step_timeout
        try:
            proposals = self._round_trips(requests, deadline)
        except TimeoutError:
            self._fail("timeout")
            raise DraftTimeout(f"draft server did not answer within {self.step_timeout:g} s") from None
        except (OSError, WebSocketException) as exc:
            self._fail("connection")
            raise RemoteDraftError(f"draft server connection failed: {type(exc).__name__}: {exc}") from None
        except AuthenticationFailed:
            self._fail("auth")
            raise
        except ProtocolError:
            self._fail("protocol")
            raise
        except IncompatibleDraftError:
            self._fail("incompatible")
            raise
        except ServerRefused:
            self.metrics.failures.labels(kind="server").inc()  # the connection itself is fine
            raise
        self.last_timing = (self.clock() - started, self._server_seconds)
        self.metrics.round_trip.observe(self.last_timing[0])
        self.metrics.server_time.observe(self._server_seconds)
        return proposals

    def commit(self, slot: int, proposal: Proposal, acceptance: Acceptance) -> None:
        if slot in self._sent:
            self._commits[slot] = tuple(acceptance.path)

    def release(self, slot: int) -> None:
        self._commits.pop(slot, None)
        if self._sent.pop(slot, None) is not None:
            self._releases.add(slot)

    def retain(self, slot: int, length: int) -> None:
        """The draft server keeps nothing of finished sequences."""
        self.release(slot)

    def share(self, src: int, dst: int, length: int) -> int:
        """The sequence starts afresh on the draft server; the target may skip every shared token."""
        self.release(dst)
        return length

    def move(self, src: int, dst: int) -> None:
        """The draft server keys sessions by slot: the sequence starts afresh under ``dst``."""
        self.release(src)

    def observe(self, slot: int, token_ids: list[int], width: int, since: int) -> None:
        """The protocol has no message for it: probe trees measure a remote draft."""

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # -- the wire ----------------------------------------------------------------------------
    def _round_trips(self, requests: list[DraftRequest], deadline: float) -> list[Proposal]:
        """One round trip, and a second for the sequences the server no longer holds.

        A request the server refuses (too long for its cache, no free session) is not drafted
        this step (a root-only tree), while the others are; only when all are refused does the
        step fail.
        """
        conn = self._connection(deadline)
        self._server_seconds = 0.0
        sampling = [self._sampling(r) for r in requests]  # drawn once: a resend reuses the seed
        starts = [min(self._sent.get(r.slot, 0), len(r.token_ids) - 1) for r in requests]
        message = StepMessage(
            tuple(sorted(self._releases)),
            tuple(Commit(slot, path) for slot, path in self._commits.items()),
            tuple(wire_request(r, start, s) for r, start, s in zip(requests, starts, sampling, strict=True)),
        )
        results = self._exchange(conn, message, deadline)
        self._releases.clear()
        self._commits.clear()
        retry = {i: r.held for i, r in enumerate(results) if isinstance(r, Resend)}
        if retry:
            self.metrics.resends.inc(len(retry))
            again = StepMessage(
                requests=tuple(wire_request(requests[i], held, sampling[i]) for i, held in retry.items())
            )
            for i, result in zip(retry, self._exchange(conn, again, deadline), strict=True):
                results[i] = result
        proposals, refused = [], []
        for req, start, result in zip(requests, starts, results, strict=True):
            if isinstance(result, Drafted):
                self._sent[req.slot] = len(req.token_ids)
                proposals.append(self._proposal(result))
            else:
                self._sent[req.slot] = start if isinstance(result, Failed) else 0
                refused.append(result.reason if isinstance(result, Failed) else "session lost twice")
                proposals.append(Proposal(TokenTree.chain([req.token_ids[-1]])))
        if refused:
            self.metrics.refused.inc(len(refused))
            log.debug("draft server refused %d of %d requests: %s", len(refused), len(requests), refused[0])
        if len(refused) == len(requests):
            raise ServerRefused(f"draft server: {refused[0]}")
        return proposals

    @staticmethod
    def _sampling(req: DraftRequest) -> Sampling | None:
        """A sampled request's settings, with a seed from its own generator (reproducible runs)."""
        if req.sample is None:
            return None
        p = req.sample.processing
        seed = int(torch.randint(0, 2**63 - 1, (), generator=req.sample.generators.on(torch.device("cpu"))))
        return Sampling(p.temperature, p.top_p, p.top_k, seed)

    @staticmethod
    def _proposal(result: Drafted) -> Proposal:
        """Float32 rows as the float64 distributions children were drawn from (the sampler
        normalised them the same way). Whether the tree fits its request is ``GuardedDrafter``'s
        check, the one every drafter's proposals pass."""
        probs = {}
        for node, row in result.draft_probs.items():
            q = row.double()
            probs[node] = q / q.sum()
        return Proposal(result.tree, probs)

    def _exchange(self, conn: ClientConnection, message: StepMessage, deadline: float) -> list:
        conn.send(encode_step(message))
        remaining = deadline - self.clock()
        if remaining <= 0:
            raise TimeoutError
        data = conn.recv(timeout=remaining)
        if not isinstance(data, bytes):
            raise ProtocolError("draft server sent text where a step reply was expected")
        assert self.info is not None
        reply = decode_reply(data, self.info.vocab_size)
        if len(reply.results) != len(message.requests):
            raise ProtocolError(f"{len(reply.results)} results for {len(message.requests)} requests")
        self._server_seconds += reply.server_seconds
        return reply.results

    def _connection(self, deadline: float) -> ClientConnection:
        if self._conn is not None:
            return self._conn
        timeout = max(0.01, min(self.connect_timeout, deadline - self.clock()))
        conn = connect(
            self.url, open_timeout=timeout, close_timeout=0.5, compression=None, max_size=None, legacy=True
        )
        try:
            info = self._handshake(conn, deadline)
            if self.fingerprint is not None and info.fingerprint != self.fingerprint:
                raise IncompatibleDraftError(
                    f"draft server's model {info.model!r} has a different tokenizer from the target's; "
                    "a draft must share the target's tokenizer"
                )
        except BaseException:
            conn.close()
            raise
        self.metrics.reconnects.inc()
        log.info("connected to draft server %s (%s)", self.url, info.model)
        self.info, self._conn = info, conn
        self._delay = self.backoff[0]
        return conn

    def _handshake(self, conn: ClientConnection, deadline: float) -> ServerInfo:
        """Hello, the server's challenge (and proof), our answer, then the server's info."""

        def receive() -> str | bytes:
            return conn.recv(timeout=max(0.01, deadline - self.clock()))

        nonce = handshake.new_nonce()
        conn.send(handshake.client_hello(self.client_id, nonce))
        challenge = handshake.parse_challenge(receive())
        if self.secret is None and challenge.auth:
            raise AuthenticationFailed("the draft server requires the draft secret (--draft-secret)")
        if self.secret is not None and not handshake.verified(
            self.secret, "server", challenge.nonce, nonce, challenge.proof
        ):
            raise AuthenticationFailed("the draft server did not prove it holds the draft secret")
        conn.send(handshake.answer(nonce, challenge.nonce, self.secret))
        hello = receive()
        return ServerInfo.from_json(hello if isinstance(hello, str) else hello.decode())

    def _fail(self, kind: str) -> None:
        """Drop the connection (a late reply must never answer the next step) and back off."""
        self.metrics.failures.labels(kind=kind).inc()
        self.close()
        self._next_attempt = self.clock() + self._delay
        self._delay = min(self._delay * 2, self.backoff[1])
        # The server may hold anything for our slots now: start every sequence afresh.
        self._releases.update(self._sent)
        self._sent.clear()
        self._commits.clear()
