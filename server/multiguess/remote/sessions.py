"""The draft server's sessions: which draft-cache slot serves which (client, slot), and eviction.

A session is one sequence of one target server. The draft model has a fixed number of cache
slots; when they are all taken the least recently used session is evicted, and a session idle
for too long is evicted too (a target that died never says goodbye). An evicted session's next
request is answered with ``Resend`` and the target sends the whole sequence again, so eviction
costs a re-prefill, never wrong output.

The client part of a key is the server's name for one connection, never what a client claims:
a connection reaches only its own sessions. Each connection holds at most ``per_client``
sessions; past that its own least recently used one makes room, so one connection cannot
evict everybody else's.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from multiguess.engine.tree import TokenTree

Key = tuple[str, int]  # (client id, the client's slot)


@dataclass
class Session:
    slot: int  # the draft model's cache slot
    tokens: list[int] = field(default_factory=list)  # the sequence the draft cache holds
    tree: TokenTree | None = None  # the last proposed tree, until its commit
    prefix: int = 0  # sequence length when that tree was proposed
    last_used: float = 0.0


class SessionsFull(RuntimeError):
    """Every slot is held by a session of the batch being served."""


class SessionTable:
    def __init__(
        self,
        max_sessions: int,
        idle_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        per_client: int | None = None,
    ) -> None:
        if max_sessions < 1 or idle_seconds <= 0 or (per_client is not None and per_client < 1):
            raise ValueError("max_sessions and per_client must be >= 1 and idle_seconds > 0")
        self.per_client = min(per_client or max_sessions, max_sessions)
        self.idle_seconds = idle_seconds
        self.clock = clock
        self._sessions: OrderedDict[Key, Session] = OrderedDict()  # least recently used first
        self._free = list(range(max_sessions))

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, key: Key) -> Session | None:
        """The session, marked as just used."""
        session = self._sessions.get(key)
        if session is not None:
            session.last_used = self.clock()
            self._sessions.move_to_end(key)
        return session

    def create(self, key: Key, pinned: Iterable[Key] = ()) -> tuple[Session, list[Session]]:
        """A new session for ``key`` (dropping any old one), and the session evicted to make room.

        Sessions in ``pinned`` (the rest of the batch being served) are never evicted.
        """
        self.remove(key)
        own = [k for k in self._sessions if k[0] == key[0]]
        if len(own) >= self.per_client:
            candidates, full = own, f"this connection holds its limit of {self.per_client} draft sessions"
        elif not self._free:
            candidates, full = (
                list(self._sessions),
                f"all {len(self._sessions)} draft sessions are in use by this batch",
            )
        else:
            candidates, full = [], ""
        evicted: list[Session] = []
        if full:
            keep = set(pinned)
            victim = next((k for k in candidates if k not in keep), None)
            if victim is None:
                raise SessionsFull(full)
            evicted.append(self._sessions[victim])
            self.remove(victim)
        session = Session(self._free.pop(0), last_used=self.clock())
        self._sessions[key] = session
        return session, evicted

    def remove(self, key: Key) -> Session | None:
        session = self._sessions.pop(key, None)
        if session is not None:
            self._free.append(session.slot)
        return session

    def move(self, client: str, moves: Iterable[tuple[int, int]]) -> list[Session]:
        """The client's sequences moved to other slots (``(from, to)`` pairs, all at once, as
        the target moved them); returns the sessions they displaced (the client had released
        those slots, or never drafted there)."""
        taken = [(dst, self._sessions.pop((client, src), None)) for src, dst in moves]
        displaced = [s for s in (self.remove((client, dst)) for dst, _ in taken) if s is not None]
        for dst, session in taken:
            if session is not None:
                self._sessions[(client, dst)] = session
        return displaced

    def remove_client(self, client: str) -> list[Session]:
        """Drop every session of one connection (it closed)."""
        keys = [k for k in self._sessions if k[0] == client]
        return [s for s in (self.remove(k) for k in keys) if s is not None]

    def expire(self) -> list[Session]:
        """Evict the sessions idle for longer than ``idle_seconds``."""
        cutoff = self.clock() - self.idle_seconds
        stale = [k for k, s in self._sessions.items() if s.last_used < cutoff]
        return [s for s in (self.remove(k) for k in stale) if s is not None]
