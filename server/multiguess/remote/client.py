"""``RemoteDrafter``: the target side of remote drafting, a drafter like the local ones.

Each engine step is one round trip on one persistent WebSocket. Only what the draft server
lacks travels: per sequence, the tokens emitted since the last step (the accepted path is
sent along, so the server keeps those tokens' draft KV). Commits, releases and moves ride on
the next step's message instead of costing round trips of their own.

A server whose head reads the target's hidden states (EAGLE-3) names the layers at the
handshake; the drafter then offers them as ``feature_layers``, so the engine captures them
and hands them over with ``add_features``, and each request carries the features of the
positions the server has not been sent (bfloat16; a message that would outgrow the server's
frame limit sends the latest positions only, which costs acceptance, never correctness).

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
from websockets.exceptions import ConnectionClosed, WebSocketException
from websockets.sync.client import ClientConnection, connect

from multiguess.engine.acceptance import Acceptance
from multiguess.engine.drafter import DraftRequest, Proposal, SampleSpec
from multiguess.engine.drafters.base import Drafter
from multiguess.engine.tree import TokenTree
from multiguess.errors import IncompatibleDraftError
from multiguess.remote import handshake
from multiguess.remote.handshake import AuthenticationFailed
from multiguess.remote.metrics import ClientMetrics
from multiguess.remote.protocol import (
    MESSAGE_TOO_BIG,
    PROTOCOL_ERROR,
    Commit,
    Drafted,
    Failed,
    Features,
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


def wire_request(
    req: DraftRequest, start: int, sampling: Sampling | None, features: Features | None = None
) -> Request:
    """``req`` for a server holding ``start`` of its tokens (at least the root is sent)."""
    start = min(max(start, 0), len(req.token_ids) - 1)
    return Request(req.slot, start, tuple(req.token_ids[start:]), req.budget, sampling, features)


def rows_within(rows: list[int], budget: int) -> list[int]:
    """How many of each request's latest feature rows fit ``budget`` rows in all: every request
    keeps up to one common cap, the largest that fits (the prompts' long blocks are cut first)."""
    if sum(rows) <= budget:
        return list(rows)
    low, high = 0, max(rows)
    while low < high:  # the largest cap c with sum(min(r, c)) <= budget
        cap = (low + high + 1) // 2
        low, high = (cap, high) if sum(min(r, cap) for r in rows) <= budget else (low, cap - 1)
    return [min(r, low) for r in rows]


class FeatureBuffer:
    """The target's features of one sequence from ``position`` on, not yet sent (host bfloat16)."""

    def __init__(self, position: int) -> None:
        self.position = position
        self.chunks: list[torch.Tensor] = []
        self.rows = 0

    @property
    def end(self) -> int:
        return self.position + self.rows

    def add(self, position: int, features: torch.Tensor, limit: int) -> None:
        """Append rows at ``position`` (they restart the buffer if they do not continue it);
        only the latest ``limit`` rows are kept."""
        if position != self.end:
            self.position, self.chunks, self.rows = position, [], 0
        self.chunks.append(features.detach().to("cpu", torch.bfloat16))
        self.rows += len(features)
        if self.rows > limit:
            self.chunks = [torch.cat(self.chunks)[-limit:]]
            self.position, self.rows = self.end - limit, limit

    def wire(self, rows: int) -> Features | None:
        """The latest ``rows`` rows as they travel (None: none)."""
        if rows <= 0 or not self.rows:
            return None
        values = torch.cat(self.chunks)[-rows:] if len(self.chunks) > 1 else self.chunks[0][-rows:]
        return Features.of(self.end - len(values), values)


def closed_for_protocol(exc: BaseException) -> bool:
    """Whether the server closed the connection because a message broke the protocol."""
    if not isinstance(exc, ConnectionClosed) or exc.rcvd is None:
        return False
    return exc.rcvd.code in (PROTOCOL_ERROR, MESSAGE_TOO_BIG)


def failure_kind(exc: BaseException) -> str | None:
    """The ``failures`` metric's kind of a failed connection or round trip (None: not one)."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, (OSError, WebSocketException)):
        return "protocol" if closed_for_protocol(exc) else "connection"
    if isinstance(exc, AuthenticationFailed):
        return "auth"
    if isinstance(exc, ProtocolError):
        return "protocol"
    if isinstance(exc, IncompatibleDraftError):
        return "incompatible"
    return None


def default_client_id() -> str:
    """Unique per target server process: its sessions on a shared draft server never collide."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class RemoteDrafter(Drafter):
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
        target_config: object | None = None,
    ) -> None:
        """``tokenizer`` is the target's: the server's must match it (checked on connect).
        ``secret`` is the deployment's draft secret (``--draft-secret``), if it has one.
        ``target_config`` (the target's transformers config) lets a server whose head reads
        the target's features be checked against the target's layers and width; without it,
        such a server is refused."""
        if step_timeout <= 0 or connect_timeout <= 0 or not 0 < backoff[0] <= backoff[1]:
            raise ValueError("timeouts must be > 0 and backoff (first, max) with 0 < first <= max")
        self.url = websocket_url(url)
        self.fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
        self.step_timeout = step_timeout
        self.connect_timeout = connect_timeout
        self.backoff = backoff
        self.client_id = client_id or default_client_id()
        self.secret = secret
        self.target_config = target_config
        self.clock = clock
        self.metrics = ClientMetrics(registry or CollectorRegistry())
        self.info: ServerInfo | None = None
        # The last successful step: (round trip, the server's own compute), in seconds.
        self.last_timing: tuple[float, float] = (0.0, 0.0)
        self._server_seconds = 0.0
        self._conn: ClientConnection | None = None
        self._next_attempt = 0.0
        self._last_failure = ""  # why the connection was last dropped, for the next step's error
        self._delay = backoff[0]
        self._sent: dict[int, int] = {}  # slot -> sequence length at its last request
        self._commits: dict[int, tuple[int, ...]] = {}  # accepted paths not sent yet
        self._releases: set[int] = set()  # as the server names them (before this step's moves)
        self._origin: dict[int, int] = {}  # slot -> the server's name for it, for moved sequences
        self._features: dict[int, FeatureBuffer] = {}  # slot -> features the server has not had

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers the server's head reads (none for a draft model, or before the
        first connection)."""
        return self.info.feature_layers if self.info is not None else ()

    def add_features(self, slot: int, position: int, features: torch.Tensor) -> None:
        """The target's features ``[m, width]`` of ``slot``'s positions from ``position`` on,
        kept until a proposal of the server shows it has them."""
        info = self.info
        if info is None or not len(features) or features.shape[-1] != info.feature_width:
            return  # captured for a server this drafter no longer talks to
        buffer = self._features.setdefault(slot, FeatureBuffer(position))
        buffer.add(position, features, info.max_model_len)

    # -- the Drafter interface ---------------------------------------------------------------
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        started = self.clock()
        if self._conn is None and started < self._next_attempt:
            raise RemoteDraftError(
                f"reconnecting to the draft server in {self._next_attempt - started:.1f} s "
                f"(after {self._last_failure})"
            )
        deadline = started + self.step_timeout
        try:
            proposals = self._round_trips(requests, deadline)
        except ServerRefused:
            self.metrics.failures.labels(kind="server").inc()  # the connection itself is fine
            raise
        except Exception as exc:
            kind = failure_kind(exc)
            if kind is None:
                raise
            self._fail(kind, exc)
            if kind == "timeout":
                raise DraftTimeout(f"draft server did not answer within {self.step_timeout:g} s") from None
            if isinstance(exc, (OSError, WebSocketException)):
                raise RemoteDraftError(
                    f"draft server connection failed: {type(exc).__name__}: {exc}"
                ) from None
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
        self._features.pop(slot, None)
        named = self._origin.pop(slot, slot)
        if self._sent.pop(slot, None) is not None:
            self._releases.add(named)

    def retain(self, slot: int, length: int) -> None:
        """The draft server keeps nothing of finished sequences."""
        self.release(slot)

    def share(self, src: int, dst: int, length: int) -> int:
        """The sequence starts afresh on the draft server; the target may skip every shared token,
        unless the server's head reads features: it holds none of them, so the target computes
        them all (as for a local head that holds none)."""
        self.release(dst)
        return 0 if self.feature_layers else length

    def move(self, src: int, dst: int) -> None:
        """The sequence's session follows it to ``dst`` (the next message says so); the server
        holds nothing for what ``dst`` held before (it was released)."""
        self.release(dst)
        for state in (self._sent, self._commits, self._features):
            if src in state:
                state[dst] = state.pop(src)  # type: ignore[index]
        if dst in self._sent:
            self._origin[dst] = self._origin.pop(src, src)

    def observe(
        self, slot: int, token_ids: list[int], width: int, since: int, sample: SampleSpec | None = None
    ) -> None:
        """The protocol has no message for it: probe trees measure a remote draft."""

    def connect(self) -> bool:
        """Connect now rather than at the first proposal, so that the server's feature layers
        are known before the first prompt is computed (the features of a prompt computed
        before that never reach the server: its head drafts from the later positions). A
        failure is logged and counted, and the next proposal tries again; never raises."""
        if self._conn is not None:
            return True
        try:
            self._connection(self.clock() + self.connect_timeout)
        except Exception as exc:  # the draft server may well start after the target
            log.warning("draft server %s not reachable yet: %s: %s", self.url, type(exc).__name__, exc)
            self._fail(failure_kind(exc) or "connection", exc)
            return False
        return True

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
        features = self._wire_features(requests)
        message = StepMessage(
            tuple(sorted(self._releases)),
            tuple(Commit(slot, path) for slot, path in self._commits.items()),
            tuple(
                wire_request(r, start, s, f)
                for r, start, s, f in zip(requests, starts, sampling, features, strict=True)
            ),
            tuple((named, slot) for slot, named in self._origin.items() if named != slot),
        )
        results = self._exchange(conn, message, deadline)
        self._releases.clear()
        self._commits.clear()
        self._origin.clear()
        retry = {i: r.held for i, r in enumerate(results) if isinstance(r, Resend)}
        if retry:
            self.metrics.resends.inc(len(retry))
            again = StepMessage(
                requests=tuple(
                    wire_request(requests[i], held, sampling[i], features[i]) for i, held in retry.items()
                )
            )
            for i, result in zip(retry, self._exchange(conn, again, deadline), strict=True):
                results[i] = result
        proposals, refused = [], []
        for req, start, result in zip(requests, starts, results, strict=True):
            if isinstance(result, Drafted):
                self._sent[req.slot] = len(req.token_ids)
                self._features.pop(req.slot, None)  # the server has them now
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

    def _wire_features(self, requests: list[DraftRequest]) -> list[Features | None]:
        """Each request's unsent features, the latest positions only where all of them would
        make the message larger than the server accepts."""
        buffers = [self._features.get(r.slot) for r in requests]
        if not any(buffers):
            return [None] * len(requests)
        assert self.info is not None
        tokens = sum(len(r.token_ids) for r in requests)
        room = self.info.max_frame_bytes - 4 * tokens - 64 * len(requests) - 4096  # the rest of the frame
        budget = max(0, room) // (2 * self.info.feature_width)
        kept = rows_within([b.rows if b is not None else 0 for b in buffers], budget)
        return [b.wire(n) if b is not None else None for b, n in zip(buffers, kept, strict=True)]

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
        frame = encode_step(message)
        conn.send(frame)
        self.metrics.sent_bytes.inc(len(frame))
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
            problem = feature_problem(info, self.target_config)
            if problem:
                raise IncompatibleDraftError(f"draft server's head {info.model!r} {problem}")
        except BaseException:
            conn.close()
            raise
        self.metrics.reconnects.inc()
        log.info("connected to draft server %s (%s)", self.url, info.model)
        if self.info is not None and (info.feature_layers, info.feature_width) != (
            self.info.feature_layers,
            self.info.feature_width,
        ):
            self._features.clear()  # captured at the previous server's layers
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

    def _fail(self, kind: str, exc: BaseException) -> None:
        """Drop the connection (a late reply must never answer the next step) and back off."""
        self.metrics.failures.labels(kind=kind).inc()
        self.close()
        self._last_failure = f"{type(exc).__name__}: {exc}"
        self._next_attempt = self.clock() + self._delay
        self._delay = min(self._delay * 2, self.backoff[1])
        # The server may hold anything for our slots now: start every sequence afresh (the
        # features not sent yet are kept: they start the sequences on the server again).
        self._releases.update(self._origin.get(slot, slot) for slot in self._sent)
        self._sent.clear()
        self._commits.clear()
        self._origin.clear()


def feature_problem(info: ServerInfo, target_config: object | None) -> str | None:
    """Why the target cannot feed the server's head its features, or None (it reads none, or
    the layers and width fit the target)."""
    if not info.feature_layers:
        return None
    if target_config is None:
        return "reads the target's features, and this drafter was not given the target's config"
    layers = int(getattr(target_config, "num_hidden_layers", 0))
    hidden = int(getattr(target_config, "hidden_size", 0))
    if any(i >= layers for i in info.feature_layers):
        return f"reads layers {list(info.feature_layers)}; the target has {layers}"
    if info.feature_width != len(info.feature_layers) * hidden:
        return (
            f"reads features {info.feature_width} wide; the target's are "
            f"{len(info.feature_layers)} x {hidden}"
        )
    return None
