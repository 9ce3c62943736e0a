"""A fault-injecting drafter: a real drafter that can be told to fail or to be slow."""

from __future__ import annotations

import time
from dataclasses import dataclass

from multiguess.engine.acceptance import Acceptance
from multiguess.engine.drafter import Drafter, DraftRequest, Proposal, SampleSpec


@dataclass
class Faults:
    fail: bool = False
    delay: float = 0.0  # real seconds each propose sleeps first
    lag: float = 0.0  # seconds each propose seems to take on ``clock`` (no real waiting)
    proposals: int = 0  # proposals the inner drafter made
    skew: float = 0.0

    def clock(self) -> float:
        """The guard's clock: real time plus the simulated lag so far."""
        return time.monotonic() + self.skew


class FaultyDrafter:
    def __init__(self, inner: Drafter, faults: Faults) -> None:
        self.inner, self.faults = inner, faults

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        if self.faults.delay:
            time.sleep(self.faults.delay)
        self.faults.skew += self.faults.lag
        if self.faults.fail:
            raise RuntimeError("injected draft failure")
        self.faults.proposals += 1
        return self.inner.propose(requests)

    def commit(self, slot: int, proposal: Proposal, acceptance: Acceptance) -> None:
        self.inner.commit(slot, proposal, acceptance)

    def release(self, slot: int) -> None:
        self.inner.release(slot)

    def retain(self, slot: int, length: int) -> None:
        self.inner.retain(slot, length)

    def share(self, src: int, dst: int, length: int) -> int:
        return self.inner.share(src, dst, length)

    def move(self, src: int, dst: int) -> None:
        self.inner.move(src, dst)

    def observe(
        self, slot: int, token_ids: list[int], width: int, since: int, sample: SampleSpec | None = None
    ) -> list[int | None] | None:
        if self.faults.fail:
            raise RuntimeError("injected draft failure")
        return self.inner.observe(slot, token_ids, width, since, sample)
