"""A drafter wrapper that keeps a failing or slow drafter from hurting requests.

The engine already decodes a step with the target alone when ``propose`` raises. The guard
adds what a server needs on top: a per-step time limit, a cool-down after a failure during
which speculation is paused instead of retried every step, and ``degraded``/``reason`` for
readiness. Output stays exact throughout: the target verifies whatever is (not) proposed.

The inner drafter runs inline and its time is checked afterwards: handing each step to a
watchdog thread costs more per step on a busy CPU than a GPU step can spare. A slow
step's proposal is still used (it is correct, and already paid for); the pause starts after
it. A drafter that can block indefinitely (a remote one) must bound its own calls.

Nothing a drafter returns reaches the target unchecked: a remote draft server is another
process on the network. Every proposal is validated (``proposal_problem``) before the engine
sees it; one that does not fit its request is a draft failure like an exception.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from multiguess.engine.acceptance import Acceptance
from multiguess.engine.drafter import DraftRequest, Proposal, SampleSpec
from multiguess.engine.drafters.base import Drafter, WrappedDrafter
from multiguess.engine.tree import TokenTree

log = logging.getLogger(__name__)


FALLBACK_REASONS = ("timeout", "refused", "invalid", "paused", "error")


def fallback_reason(exc: BaseException) -> str:
    """Why a step decoded without its drafter, one of ``FALLBACK_REASONS``: what the exception
    says of itself (``fallback_reason``), else a timeout or a plain error."""
    reason = getattr(exc, "fallback_reason", None)
    if reason in FALLBACK_REASONS:
        return reason
    return "timeout" if isinstance(exc, TimeoutError) else "error"


class DrafterUnavailable(RuntimeError):
    """Raised from ``propose`` while speculation is paused."""

    fallback_reason = "paused"


class InvalidDraft(ValueError):
    """A drafter returned proposals that do not fit the requests (wrong count, tree or rows)."""

    fallback_reason = "invalid"


def tree_problem(tree: object, request: DraftRequest, vocab_size: int) -> str | None:
    """Why ``tree`` cannot be verified for ``request``, or None: shape, root, sizes, token ids."""
    if not isinstance(tree, TokenTree):
        return f"a proposal's tree is a {type(tree).__name__}, not a TokenTree"
    tokens, parents = tree.tokens, tree.parents
    if not tokens or len(parents) != len(tokens) or parents[0] != -1:
        return "a tree needs the root first and one parent per token"
    if any(not 0 <= p < i for i, p in enumerate(parents[1:], start=1)):
        return "a tree's parents must precede their children"
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in tokens):
        return f"a tree has token ids outside the vocabulary [0, {vocab_size})"
    if tokens[0] != request.token_ids[-1]:
        return f"a tree's root is token {tokens[0]}, the sequence ends in {request.token_ids[-1]}"
    budget = request.budget
    depths = [0] * len(tokens)
    for i, p in enumerate(parents[1:], start=1):
        depths[i] = depths[p] + 1
    if max(depths) > budget.depth:
        return f"a tree is {max(depths)} deep, the budget allows {budget.depth}"
    if len(tokens) - 1 > budget.max_nodes:
        return f"a tree has {len(tokens) - 1} drafted nodes, the budget allows {budget.max_nodes}"
    return None


def rows_problem(proposal: Proposal, vocab_size: int) -> str | None:
    """Why the draft distributions cannot be used by sampled acceptance, or None: one finite,
    non-negative row of the vocabulary's size per node, giving each of its children mass
    (checked on all rows stacked: a step's rows cost a few tensor operations, not one each)."""
    tree, probs = proposal.tree, proposal.draft_probs
    if not probs:
        return None
    if any(not isinstance(node, int) or not 0 <= node < len(tree) for node in probs):
        return f"a distribution names a node outside the {len(tree)}-node tree"
    rows = list(probs.values())
    if any(
        not isinstance(r, torch.Tensor) or r.shape != (vocab_size,) or not r.is_floating_point() for r in rows
    ):
        return f"a distribution is not a float row of {vocab_size} entries"
    stacked = torch.stack([r.to(rows[0].device, torch.float64) for r in rows])
    children = tree.children()
    kids = [(i, tree.tokens[c]) for i, node in enumerate(probs) for c in children[node]]
    index = torch.tensor(kids, dtype=torch.long, device=stacked.device).reshape(-1, 2)
    valid = torch.isfinite(stacked).all() & (stacked >= 0).all() & (stacked.sum(dim=1) > 0).all()
    if not bool(valid & (stacked[index[:, 0], index[:, 1]] > 0).all()):
        return "a distribution is not one its children could have been drawn from"
    return None


def proposal_problem(request: DraftRequest, proposal: object, vocab_size: int) -> str | None:
    """Why ``proposal`` must not reach the target for ``request``, or None."""
    if not isinstance(proposal, Proposal):
        return f"a proposal is a {type(proposal).__name__}, not a Proposal"
    if not isinstance(proposal.draft_probs, dict):
        return "a proposal's distributions are not a dict"
    return tree_problem(proposal.tree, request, vocab_size) or rows_problem(proposal, vocab_size)


class _PausedStepFilter(logging.Filter):
    """Drops the engine's per-step fallback warning while paused: the guard already logged the
    cause once, and a cool-down would otherwise log a line for every step."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not any(isinstance(arg, DrafterUnavailable) for arg in args)


_ENGINE_LOG = logging.getLogger("multiguess.engine.engine")


class GuardedDrafter(WrappedDrafter):
    """``inner`` behind the guard: its abilities, memory and sizing are its own (``WrappedDrafter``);
    its failures pause speculation for ``cooldown`` seconds and mark the guard ``degraded``."""

    def __init__(
        self,
        inner: Drafter,
        vocab_size: int,
        step_timeout: float = 2.0,
        cooldown: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if step_timeout <= 0 or cooldown < 0:
            raise ValueError("step_timeout must be > 0 and cooldown >= 0")
        super().__init__(inner)
        self.vocab_size = vocab_size
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
        problem = self._problem(requests, proposals)
        if problem is not None:
            self._trip(f"invalid draft: {problem}")
            raise InvalidDraft(problem)
        elapsed = self.clock() - started
        if elapsed > self.step_timeout:
            self._trip(f"a draft step took {elapsed:.2f} s, longer than the limit of {self.step_timeout:g} s")
        elif self.degraded:
            log.info("drafter recovered; speculation resumed")
            self.degraded, self.reason = False, None
        return proposals

    def _problem(self, requests: list[DraftRequest], proposals: object) -> str | None:
        if not isinstance(proposals, list) or len(proposals) != len(requests):
            return f"{len(proposals) if isinstance(proposals, list) else 'no'} proposals for {len(requests)} requests"
        for request, proposal in zip(requests, proposals, strict=True):
            problem = proposal_problem(request, proposal, self.vocab_size)
            if problem is not None:
                return f"slot {request.slot}: {problem}"
        return None

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

    def retain(self, slot: int, length: int) -> None:
        """A failing retain drops the slot's state."""
        try:
            self.inner.retain(slot, length)
        except Exception as exc:
            self._trip(f"retain failed: {type(exc).__name__}: {exc}")
            self.release(slot)

    def share(self, src: int, dst: int, length: int) -> int:
        """A failing share drops ``dst``'s state: the sequence starts afresh in the drafter, and
        the target may skip every shared token."""
        try:
            return self.inner.share(src, dst, length)
        except Exception as exc:
            self._trip(f"share failed: {type(exc).__name__}: {exc}")
            self.release(dst)
            return length

    def move(self, src: int, dst: int) -> None:
        """A failing move leaves the inner drafter unsure of both slots: drop them."""
        try:
            self.inner.move(src, dst)
        except Exception as exc:
            self._trip(f"move failed: {type(exc).__name__}: {exc}")
            self.release(src)
            self.release(dst)

    def observe(
        self, slot: int, token_ids: list[int], width: int, since: int, sample: SampleSpec | None = None
    ) -> list[int | None] | None:
        """Nothing while paused; a failure trips the guard and drops the slot's state."""
        if self.clock() < self._paused_until:
            return None
        try:
            return self.inner.observe(slot, token_ids, width, since, sample)
        except Exception as exc:
            self._trip(f"observe failed: {type(exc).__name__}: {exc}")
            self.release(slot)
            return None

    def prefill(self, slot: int, token_ids: list[int]) -> None:
        """Passed on unless paused (the inner drafter catches up at its next proposal then); a
        failure trips the guard and drops the slot."""
        if self.clock() < self._paused_until:
            return
        try:
            self.inner.prefill(slot, token_ids)
        except Exception as exc:
            self._trip(f"prefill failed: {type(exc).__name__}: {exc}")
            self.release(slot)

    def add_features(self, slot: int, position: int, features: torch.Tensor) -> None:
        """Handed over even while paused, so the inner drafter stays in step; a failure trips
        the guard and drops the slot's state."""
        try:
            self.inner.add_features(slot, position, features)
        except Exception as exc:
            self._trip(f"add_features failed: {type(exc).__name__}: {exc}")
            self.release(slot)

    def _trip(self, reason: str) -> None:
        self.failures += 1
        self.degraded, self.reason = True, reason
        self._paused_until = self.clock() + self.cooldown
        log.warning("drafter unavailable for %g s: %s", self.cooldown, reason)
