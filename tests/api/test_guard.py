"""GuardedDrafter on its own: time limit, cool-down, recovery, and cleanup of abandoned calls."""

from __future__ import annotations

import threading

import pytest
from multiguess.engine.acceptance import Acceptance
from multiguess.engine.drafter import DraftRequest, Proposal, TreeBudget
from multiguess.engine.guard import DrafterUnavailable, GuardedDrafter
from multiguess.engine.tree import TokenTree


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ChainDrafter:
    """Proposes root + one fixed token; can fail, or block until released."""

    def __init__(self) -> None:
        self.fail = False
        self.gate: threading.Event | None = None
        self.released: list[int] = []
        self.committed: list[int] = []

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        if self.gate is not None:
            self.gate.wait()
        if self.fail:
            raise RuntimeError("boom")
        return [Proposal(TokenTree.chain([r.token_ids[-1], 7])) for r in requests]

    def commit(self, slot: int, proposal: Proposal, acceptance: Acceptance) -> None:
        self.committed.append(slot)

    def release(self, slot: int) -> None:
        self.released.append(slot)


def requests(*slots: int) -> list[DraftRequest]:
    return [DraftRequest(slot, [1, 2, 3], TreeBudget(1, 1, 1)) for slot in slots]


def test_failure_pauses_for_the_cooldown_then_recovers() -> None:
    inner, clock = ChainDrafter(), Clock()
    guard = GuardedDrafter(inner, step_timeout=1.0, cooldown=10.0, clock=clock)
    assert len(guard.propose(requests(0))) == 1 and not guard.degraded
    inner.fail = True
    with pytest.raises(RuntimeError, match="boom"):
        guard.propose(requests(0))
    assert guard.degraded and "boom" in (guard.reason or "")
    inner.fail = False
    clock.now = 9.9
    with pytest.raises(DrafterUnavailable, match="paused"):
        guard.propose(requests(0))
    assert guard.degraded
    clock.now = 10.1
    assert guard.propose(requests(0))[0].tree.tokens == (3, 7)
    assert not guard.degraded and guard.reason is None


def test_slow_step_times_out_and_stale_slots_are_released_after_it_ends() -> None:
    inner, clock = ChainDrafter(), Clock()
    guard = GuardedDrafter(inner, step_timeout=0.05, cooldown=1.0, clock=clock)
    inner.gate = threading.Event()
    with pytest.raises(DrafterUnavailable, match="longer than"):
        guard.propose(requests(0, 1))
    guard.release(2)  # the engine releases while the abandoned call still runs
    assert inner.released == []  # the inner drafter is not touched concurrently
    clock.now = 2.0
    with pytest.raises(DrafterUnavailable):
        guard.propose(requests(0))  # still stuck: the pause is extended
    inner.gate.set()
    inner.gate = None
    clock.now = 4.0
    guard._stuck.result(timeout=5)  # type: ignore[union-attr]
    assert len(guard.propose(requests(0))) == 1
    assert sorted(inner.released) == [0, 1, 2]
    assert not guard.degraded


def test_a_failing_commit_is_contained() -> None:
    class BadCommit(ChainDrafter):
        def commit(self, slot: int, proposal: Proposal, acceptance: Acceptance) -> None:
            raise ValueError("cache out of step")

    inner = BadCommit()
    guard = GuardedDrafter(inner, cooldown=5.0, clock=Clock())
    proposal = guard.propose(requests(4))[0]
    guard.commit(4, proposal, Acceptance([0], [3]))
    assert guard.degraded and "cache out of step" in (guard.reason or "")
    assert inner.released == [4]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="step_timeout"):
        GuardedDrafter(ChainDrafter(), step_timeout=0)
