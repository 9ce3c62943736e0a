"""A drafter wrapper that keeps a failing or slow drafter from hurting requests.

The engine already decodes a step with the target alone when ``propose`` raises. The guard
adds what a server needs on top: a per-step time limit, a cool-down after a failure during
which speculation is paused instead of retried every step, and ``degraded``/``reason`` for
readiness. Output stays exact throughout: the target verifies whatever is (not) proposed.

The inner drafter runs inline and its time is checked afterwards: handing each step to a
watchdog thread cost ~3 ms per step on a busy CPU, more than a GPU step can spare. A slow
step's proposal is still used (it is correct, and already paid for); the pause starts after
it. A drafter that can block indefinitely (a remote one) must bound its own calls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from multiguess.engine.acceptance import Acceptance
from multiguess.engine.drafter import Drafter, DraftRequest, Proposal

log = logging.getLogger(__name__)


class DrafterUnavailable(RuntimeError):
    """Raised from ``propose`` while speculation is paused."""


class _PausedStepFilter(logging.Filter):
    """Drops the engine's per-step fallback warning while paused: the guard already logged the
    cause once, and a cool-down would otherwise log a line for every step."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not any(isinstance(arg, DrafterUnavailable) for arg in args)


_ENGINE_LOG = logging.getLogger("multiguess.engine.engine")


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
        if not any(isinstance(f, _PausedStepFilter) for f in _ENGINE_LOG.filters):
            _ENGINE_LOG.addFilter(_PausedStepFilter())

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        if self.clock() < self._paused_until:
            raise DrafterUnavailable(f"speculation paused after: {self.reason}")
        started = self.clock()
        try:
            proposals = self.inner.propose(requests)
        except Exception as exc:
            self._trip(f"{type(exc).__name__}: {exc}")
            raise
        elapsed = self.clock() - started
        if elapsed > self.step_timeout:
            self._trip(f"a draft step took {elapsed:.2f} s, longer than the limit of {self.step_timeout:g} s")
        elif self.degraded:
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
        try:
            self.inner.release(slot)
        except Exception as exc:
            self._trip(f"release failed: {type(exc).__name__}: {exc}")

    def move(self, src: int, dst: int) -> None:
        """A failing move leaves the inner drafter unsure of both slots: drop them."""
        try:
            self.inner.move(src, dst)
        except Exception as exc:
            self._trip(f"move failed: {type(exc).__name__}: {exc}")
            self.release(src)
            self.release(dst)

    def observe(self, slot: int, token_ids: list[int], width: int, since: int) -> list[int | None] | None:
        """Nothing while paused; a failure trips the guard and drops the slot's state."""
        if self.clock() < self._paused_until:
            return None
        try:
            return self.inner.observe(slot, token_ids, width, since)
        except Exception as exc:
            self._trip(f"observe failed: {type(exc).__name__}: {exc}")
            self.release(slot)
            return None

    def _trip(self, reason: str) -> None:
        self.failures += 1
        self.degraded, self.reason = True, reason
        self._paused_until = self.clock() + self.cooldown
        log.warning("drafter unavailable for %g s: %s", self.cooldown, reason)
