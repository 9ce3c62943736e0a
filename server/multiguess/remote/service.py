"""The draft server's logic without I/O: decoded step messages in, results out.

It drives an ordinary ``ModelDrafter`` or ``Eagle3Drafter`` (``wire_exact``: the float32 rows it
sends are exactly what was sampled): a session is one of its slots. A
model drafter's per-slot cache bookkeeping (``cached``) is kept equal to ``len(session.tokens)``;
an EAGLE-3 head's is one less (position p reads token p + 1), and the target's features a
request carries are handed to it before it drafts, as the engine hands them to a local head.
Messages of several target servers that arrive together are served by one batched ``propose``.

A head that cannot continue a session's features (the session was evicted or rewound, or the
target sent none) starts from the features it is given, or proposes the root alone until the
next ones arrive: that costs acceptance, never correctness (the target verifies every tree).

Nothing a client sends can fail another client's requests: a request is checked before it joins
the batch, and should a batched ``propose`` still fail, each request is drafted again alone, so
only the one that fails alone is answered ``Failed``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from multiguess.engine.acceptance import Acceptance
from multiguess.engine.drafter import DraftRequest, Proposal, SampleSpec
from multiguess.engine.drafters.eagle3 import Eagle3Drafter
from multiguess.engine.drafters.model import ModelDrafter
from multiguess.engine.sampling import Generators, Processing
from multiguess.remote.protocol import (
    Commit,
    Drafted,
    Failed,
    Features,
    Request,
    Resend,
    Result,
    StepMessage,
    StepReply,
)
from multiguess.remote.sessions import Key, Session, SessionsFull, SessionTable

log = logging.getLogger(__name__)


def feature_width(drafter: ModelDrafter | Eagle3Drafter) -> int:
    """Values per position of the target's features the drafter reads (0: it reads none)."""
    return drafter.feature_width if isinstance(drafter, Eagle3Drafter) else 0


@dataclass
class ServiceEvents:
    """What one ``handle`` call did, for the server's metrics."""

    evicted_lru: int = 0
    evicted_idle: int = 0
    resends: int = 0
    failed: int = 0
    drafted: int = 0
    propose_seconds: float = 0.0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def path_is_valid(session: Session, path: tuple[int, ...]) -> bool:
    """A root-first chain of the session's last tree (the only commit that means anything)."""
    tree = session.tree
    if tree is None or not path or path[0] != 0 or any(n >= len(tree) for n in path):
        return False
    return all(tree.parents[child] == parent for parent, child in itertools.pairwise(path))


class DraftService:
    def __init__(
        self,
        drafter: ModelDrafter | Eagle3Drafter,
        max_sessions: int,
        max_model_len: int,
        idle_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        per_client: int | None = None,
    ) -> None:
        """``drafter`` (started, ``wire_exact``) has ``max_sessions`` slots."""
        self.drafter = drafter
        self.vocab_size = drafter.runner.vocab_size
        self.feature_width = feature_width(drafter)
        self.max_model_len = max_model_len
        self.sessions = SessionTable(max_sessions, idle_seconds, clock, per_client)

    def handle(self, batch: list[tuple[str, StepMessage]]) -> tuple[list[StepReply], ServiceEvents]:
        """Serve the messages of several clients together; one reply per message, in order."""
        events = ServiceEvents()
        for session in self.sessions.expire():
            self.drafter.release(session.slot)
            events.evicted_idle += 1
        for client, message in batch:
            for slot in message.releases:
                self._drop((client, slot))
            for session in self.sessions.move(client, message.moves):
                self.drafter.release(session.slot)
            for commit in message.commits:
                self._commit(client, commit)
        pinned = {(client, r.slot) for client, m in batch for r in m.requests}
        results: list[list[Result | None]] = [[None] * len(m.requests) for _, m in batch]
        todo: list[tuple[int, int, Session, DraftRequest]] = []
        seen: set[Key] = set()
        for i, (client, message) in enumerate(batch):
            for j, req in enumerate(message.requests):
                key = (client, req.slot)
                if key in seen:  # one draft-cache slot cannot grow two trees at once
                    results[i][j] = Failed(f"slot {req.slot} requested twice in one step")
                    continue
                seen.add(key)
                outcome = self._prepare(key, req, pinned, events)
                if isinstance(outcome, tuple):
                    todo.append((i, j, *outcome))
                else:
                    results[i][j] = outcome
        if todo:
            started = time.perf_counter()
            self._propose(todo, results, batch)
            events.propose_seconds = time.perf_counter() - started
        replies = []
        for row in results:
            assert all(r is not None for r in row)
            replies.append(StepReply(row))  # type: ignore[arg-type]
        events.resends += sum(isinstance(r, Resend) for row in results for r in row)
        events.failed += sum(isinstance(r, Failed) for row in results for r in row)
        events.drafted += sum(isinstance(r, Drafted) for row in results for r in row)
        return replies, events

    def drop_client(self, client: str) -> int:
        """Free the sessions of a connection that closed; returns how many."""
        sessions = self.sessions.remove_client(client)
        for session in sessions:
            self.drafter.release(session.slot)
        return len(sessions)

    def _drop(self, key: Key) -> None:
        session = self.sessions.remove(key)
        if session is not None:
            self.drafter.release(session.slot)

    def _commit(self, client: str, commit: Commit) -> None:
        """Keep the draft KV of the accepted nodes the drafter had fed (see ``ModelDrafter.commit``)."""
        session = self.sessions.get((client, commit.slot))
        if session is None:
            return  # evicted meanwhile: the next request is answered with Resend
        if not path_is_valid(session, commit.path):
            log.warning("client %s sent an invalid path for slot %d; session dropped", client, commit.slot)
            self._drop((client, commit.slot))
            return
        assert session.tree is not None
        path = list(commit.path)
        self.drafter.commit(session.slot, Proposal(session.tree), Acceptance(path, []))
        kept = self.drafter.cached[session.slot] - session.prefix
        session.tokens = session.tokens[: session.prefix] + [
            session.tree.tokens[n] for n in path[1 : 1 + kept]
        ]
        session.tree = None

    def _prepare(
        self, key: Key, req: Request, pinned: set[Key], events: ServiceEvents
    ) -> Result | tuple[Session, DraftRequest]:
        """The session and draft request for ``req``, or the result that answers it instead."""
        session = self.sessions.get(key)
        if session is None and req.start > 0:
            return Resend(0)
        if session is not None and req.start > len(session.tokens):
            return Resend(len(session.tokens))
        held = session.tokens[: req.start] if session is not None else []
        sequence = held + list(req.tokens)
        features = req.features.tensor() if req.features is not None else None
        problem = self._check(sequence, req) or self._check_features(len(sequence), req.features, features)
        if problem:
            return Failed(problem)
        if session is None:
            try:
                session, evicted = self.sessions.create(key, pinned)
            except SessionsFull as exc:
                return Failed(str(exc))
            for old in evicted:
                self.drafter.release(old.slot)
            events.evicted_lru += len(evicted)
        # Keep what matches; at least the last token is fed again (propose needs one new token).
        keep = min(common_prefix(session.tokens, sequence), len(sequence) - 1)
        if keep < len(session.tokens):
            session.tokens = session.tokens[:keep]
            if self.feature_width:  # the head's positions read features of what is gone
                self.drafter.release(session.slot)
            else:
                self.drafter.cached[session.slot] = keep
        if self.feature_width:
            self._hand_features(session.slot, len(sequence), req.features, features)
        sample = None
        if req.sampling is not None:
            s = req.sampling
            sample = SampleSpec(Processing(s.temperature, s.top_p, s.top_k), Generators(s.seed))
        return session, DraftRequest(session.slot, sequence, req.budget, sample)

    def _check(self, sequence: list[int], req: Request) -> str | None:
        if not sequence:
            return "empty sequence"
        if req.budget.depth < 1:
            return "a draft request needs depth >= 1"
        if max(sequence) >= self.vocab_size:
            return f"token id {max(sequence)} is outside the draft's vocabulary of {self.vocab_size}"
        if len(sequence) > self.max_model_len:
            return f"{len(sequence)} tokens exceed the draft server's max model length ({self.max_model_len})"
        if self.max_model_len + req.budget.slack > self.drafter.runner.capacity:
            return f"tree budget {req.budget} is larger than the draft server allows (--max-tree-nodes)"
        return None

    def _check_features(self, length: int, sent: Features | None, values: torch.Tensor | None) -> str | None:
        """Features must be the head's width, end at the position before the root, and be finite."""
        if sent is None or values is None:
            return None
        if not self.feature_width:
            return "this draft server's model reads no target features"
        if sent.width != self.feature_width:
            return f"features of width {sent.width}; the head reads {self.feature_width} values a position"
        if sent.position + sent.rows != length - 1:
            return (
                f"features for positions {sent.position}..{sent.position + sent.rows - 1}; a sequence of "
                f"{length} tokens needs them to end at position {length - 2}"
            )
        if not bool(torch.isfinite(values).all()):
            return "features contain NaN or infinity"
        return None

    def _hand_features(
        self, slot: int, length: int, sent: Features | None, values: torch.Tensor | None
    ) -> None:
        """Give the head the request's features; should what it holds then not reach the root of
        a ``length``-token sequence, it forgets the sequence and proposes the root alone."""
        drafter = self.drafter
        assert isinstance(drafter, Eagle3Drafter)
        if sent is not None and values is not None:
            drafter.add_features(slot, sent.position, values)
        held = drafter.pending.get(slot)
        if held is not None and drafter.cached.get(slot, 0) + len(held) != length - 1:
            drafter.release(slot)

    def _propose(
        self,
        todo: list[tuple[int, int, Session, DraftRequest]],
        results: list[list[Result | None]],
        batch: list[tuple[str, StepMessage]],
    ) -> None:
        """Draft ``todo`` in one batch; if that fails, each request alone from its whole sequence."""
        try:
            proposals = self.drafter.propose([req for _, _, _, req in todo])
        except Exception as exc:  # the drafter's state for these slots is unknown now
            if len(todo) == 1:
                i, j, _, _ = todo[0]
                log.exception("draft propose failed")
                self._drop((batch[i][0], batch[i][1].requests[j].slot))
                results[i][j] = Failed(f"draft failed: {type(exc).__name__}: {exc}")
                return
            log.warning("a batched draft propose failed (%s); drafting its requests one by one", exc)
            for item in todo:
                self.drafter.release(item[2].slot)
                item[2].tokens = []
                self._propose([item], results, batch)
            return
        for (i, j, session, req), proposal in zip(todo, proposals, strict=True):
            session.tokens = list(req.token_ids)
            session.tree, session.prefix = proposal.tree, len(req.token_ids)
            parents = set(proposal.tree.parents)  # a childless node's row is never read: not sent
            rows = {n: q.float() for n, q in proposal.draft_probs.items() if n in parents}
            results[i][j] = Drafted(proposal.tree, rows)
