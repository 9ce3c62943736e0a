"""A drafter wrapper that keeps a failing or slow drafter from hurting requests.

The engine already decodes a step with the target alone when ``propose`` raises. The guard
adds what a server needs on top: a per-step time limit (the inner drafter runs on its own
thread, so a hung remote drafter cannot stall the batch), a cool-down after a failure during
which speculation is paused instead of retried every step, and ``degraded``/``reason`` for
readiness. Output stays exact throughout: the target verifies whatever is (not) proposed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from multiguess.engine.acceptance import Acceptance
from multiguess.engine.drafter import Drafter, DraftRequest, Proposal

log = logging.getLogger(__name__)


class DrafterUnavailable(RuntimeError):
    """Raised from ``propose`` while speculation is paused or after a too-slow step."""


class GuardedDrafter:
    def __init__(
        self,
        inner: Drafter,
        step_timeout: float = 2.0,
        cooldown: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if step_timeout <= 0 or cooldown < 0:
            raise ValueError("step_timeout must be > 0 and cooldown >= 0")
        self.inner = inner
        self.step_timeout = step_timeout
        self.cooldown = cooldown
        self.clock = clock
        self.degraded = False
        self.reason: str | None = None
        self.failures = 0
        self._paused_until = 0.0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="multiguess-drafter")
        # A timed-out call still running on the drafter thread, and the slots whose inner state
        # must be dropped once it ends (it may leave them half-updated).
        self._stuck: Future[list[Proposal]] | None = None
        self._stale_slots: set[int] = set()

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        if not self._available():
            raise DrafterUnavailable(f"speculation paused after: {self.reason}")
        future = self._pool.submit(self.inner.propose, requests)
        try:
            proposals = future.result(timeout=self.step_timeout)
        except FutureTimeout:
            self._stuck = future
            self._stale_slots.update(r.slot for r in requests)
            self._trip(f"drafter step took longer than {self.step_timeout:g} s")
            raise DrafterUnavailable(self.reason) from None
        except Exception as exc:
            self._trip(f"{type(exc).__name__}: {exc}")
            raise
        if self.degraded:
            log.info("drafter recovered; speculation resumed")
        self.degraded, self.reason = False, None
        return proposals

    def commit(self, slot: int, proposal: Proposal, acceptance: Acceptance) -> None:
        """A failing commit leaves the inner drafter unsure of that slot: drop its state."""
        try:
            self.inner.commit(slot, proposal, acceptance)
        except Exception as exc:
            self._trip(f"commit failed: {type(exc).__name__}: {exc}")
            self.release(slot)

    def release(self, slot: int) -> None:
        if self._stuck is not None:
            self._stale_slots.add(slot)  # never touch the inner drafter while a call is running
            return
        try:
            self.inner.release(slot)
        except Exception as exc:
            self._trip(f"release failed: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _available(self) -> bool:
        if self.clock() < self._paused_until:
            return False
        if self._stuck is not None:
            if not self._stuck.done():
                self._paused_until = self.clock() + self.cooldown
                return False
            self._stuck = None
            stale, self._stale_slots = self._stale_slots, set()
            for slot in stale:
                self.release(slot)
        return True

    def _trip(self, reason: str) -> None:
        self.failures += 1
        self.degraded, self.reason = True, reason
        self._paused_until = self.clock() + self.cooldown
        log.warning("drafter unavailable for %g s: %s", self.cooldown, reason)
