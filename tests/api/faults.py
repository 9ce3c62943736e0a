"""A fault-injecting drafter: a real drafter that can be told to fail or to be slow."""

from __future__ import annotations

import time
from dataclasses import dataclass

from multiguess.engine.drafter import DraftRequest, Proposal, SampleSpec
from multiguess.engine.drafters.base import Drafter, WrappedDrafter


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


class FaultyDrafter(WrappedDrafter):
    """``inner`` with injected faults. It offers neither prefill nor copy grafts: the drafter
    catches up at its first proposal and every step's tree is its own, so each step of a request
    asks it for a tree and the faults show (copy drafts alone would carry a step past them)."""

    def __init__(self, inner: Drafter, faults: Faults) -> None:
        super().__init__(inner)
        self.takes_grafts = self.prefills = False
        self.faults = faults

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        if self.faults.delay:
            time.sleep(self.faults.delay)
        self.faults.skew += self.faults.lag
        if self.faults.fail:
            raise RuntimeError("injected draft failure")
        self.faults.proposals += 1
        return self.inner.propose(requests)

    def observe(
        self, slot: int, token_ids: list[int], width: int, since: int, sample: SampleSpec | None = None
    ) -> list[int | None] | None:
        if self.faults.fail:
            raise RuntimeError("injected draft failure")
        return self.inner.observe(slot, token_ids, width, since, sample)
