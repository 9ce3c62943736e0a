"""Session bookkeeping of the draft server: LRU and idle eviction, pinned sessions."""

from __future__ import annotations

import pytest
from multiguess.remote.sessions import SessionsFull, SessionTable


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_least_recently_used_session_is_evicted() -> None:
    clock = Clock()
    table = SessionTable(2, idle_seconds=100, clock=clock)
    a, _ = table.create(("t1", 0))
    b, _ = table.create(("t2", 0))
    assert {a.slot, b.slot} == {0, 1}
    table.get(("t1", 0))  # t2's session is now the least recently used
    c, evicted = table.create(("t1", 1))
    assert evicted == [b] and c.slot == b.slot
    assert table.get(("t2", 0)) is None and table.get(("t1", 0)) is a


def test_pinned_sessions_are_never_evicted() -> None:
    table = SessionTable(2, idle_seconds=100, clock=Clock())
    table.create(("t", 0))
    table.create(("t", 1))
    _, evicted = table.create(("t", 2), pinned=[("t", 0)])
    assert [table.get(("t", 0)) is not None, table.get(("t", 1))] == [True, None]
    assert len(evicted) == 1
    with pytest.raises(SessionsFull):
        table.create(("t", 3), pinned=[("t", 0), ("t", 2)])


def test_idle_sessions_expire() -> None:
    clock = Clock()
    table = SessionTable(4, idle_seconds=10, clock=clock)
    table.create(("t", 0))
    clock.now = 6
    table.create(("t", 1))
    clock.now = 12
    assert [s.slot for s in table.expire()] == [0]
    assert len(table) == 1
    clock.now = 30
    assert len(table.expire()) == 1 and len(table) == 0


def test_released_slots_are_reused() -> None:
    table = SessionTable(1, idle_seconds=10, clock=Clock())
    first, _ = table.create(("t", 0))
    table.remove(("t", 0))
    second, evicted = table.create(("t", 5))
    assert second.slot == first.slot and evicted == []


def test_a_connection_past_its_limit_evicts_only_its_own_sessions() -> None:
    table = SessionTable(4, idle_seconds=100, clock=Clock(), per_client=2)
    other, _ = table.create(("other", 0))
    first, _ = table.create(("flood", 0))
    table.create(("flood", 1))
    _, evicted = table.create(("flood", 2))
    assert evicted == [first] and table.get(("other", 0)) is other and len(table) == 3
    with pytest.raises(SessionsFull, match="limit of 2"):
        table.create(("flood", 3), pinned=[("flood", 1), ("flood", 2)])


def test_a_closed_connection_frees_all_its_sessions() -> None:
    table = SessionTable(3, idle_seconds=100, clock=Clock())
    table.create(("gone", 0))
    table.create(("gone", 1))
    kept, _ = table.create(("stays", 0))
    assert len(table.remove_client("gone")) == 2
    assert len(table) == 1 and table.get(("stays", 0)) is kept
    assert {table.create(("new", i))[0].slot for i in range(2)} | {kept.slot} == {0, 1, 2}
