"""A fault-injecting drafter: a real drafter that can be told to fail or to be slow."""

from __future__ import annotations

import time
from dataclasses import dataclass

from multiguess.engine.acceptance import Acceptance
from multiguess.engine.drafter import Drafter, DraftRequest, Proposal


@dataclass
class Faults:
    fail: bool = False
    delay: float = 0.0  # seconds each propose sleeps first
    proposals: int = 0  # proposals the inner drafter made


class FaultyDrafter:
    def __init__(self, inner: Drafter, faults: Faults) -> None:
        self.inner, self.faults = inner, faults

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        if self.faults.delay:
            time.sleep(self.faults.delay)
        if self.faults.fail:
            raise RuntimeError("injected draft failure")
        self.faults.proposals += 1
        return self.inner.propose(requests)

    def commit(self, slot: int, proposal: Proposal, acceptance: Acceptance) -> None:
        self.inner.commit(slot, proposal, acceptance)

    def release(self, slot: int) -> None:
        self.inner.release(slot)
