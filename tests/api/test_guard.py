"""GuardedDrafter on its own: failures, the time limit, cool-down and recovery."""

from __future__ import annotations

import logging

import pytest
import torch
from multiguess.engine.acceptance import Acceptance
from multiguess.engine.drafter import DraftRequest, Proposal, SampleSpec, TreeBudget
from multiguess.engine.drafters.base import Drafter
from multiguess.engine.guard import DrafterUnavailable, GuardedDrafter, InvalidDraft, proposal_problem
from multiguess.engine.tree import TokenTree

VOCAB = 100


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ChainDrafter(Drafter):
    """Proposes root + one fixed token; can be told to fail."""

    def __init__(self) -> None:
        self.fail = False
        self.released: list[int] = []
        self.committed: list[int] = []

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        if self.fail:
            raise RuntimeError("boom")
        return [Proposal(TokenTree.chain([r.token_ids[-1], 7])) for r in requests]

    def commit(self, slot: int, proposal: Proposal, acceptance: Acceptance) -> None:
        self.committed.append(slot)

    def release(self, slot: int) -> None:
        self.released.append(slot)

    def retain(self, slot: int, length: int) -> None:
        self.released.append(slot)

    def share(self, src: int, dst: int, length: int) -> int:
        return length

    def move(self, src: int, dst: int) -> None:
        self.released.append(src)

    def observe(
        self, slot: int, token_ids: list[int], width: int, since: int, sample: SampleSpec | None = None
    ) -> list[int | None]:
        if self.fail:
            raise RuntimeError("boom")
        return [0 if t == 7 else None for t in token_ids[max(1, since) :]]


def requests(*slots: int) -> list[DraftRequest]:
    return [DraftRequest(slot, [1, 2, 3], TreeBudget(1, 1, 1)) for slot in slots]


def test_failure_pauses_for_the_cooldown_then_recovers() -> None:
    inner, clock = ChainDrafter(), Clock()
    guard = GuardedDrafter(inner, VOCAB, step_timeout=1.0, cooldown=10.0, clock=clock)
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


def test_a_slow_step_is_used_but_pauses_speculation() -> None:
    clock = Clock()

    class Slow(ChainDrafter):
        def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
            clock.now += 3.0
            return super().propose(requests)

    guard = GuardedDrafter(Slow(), VOCAB, step_timeout=1.0, cooldown=5.0, clock=clock)
    assert guard.propose(requests(0))[0].tree.tokens == (3, 7)  # correct, so kept
    assert guard.degraded and "longer than the limit of 1 s" in (guard.reason or "")
    with pytest.raises(DrafterUnavailable):
        guard.propose(requests(0))
    clock.now += 5.0
    guard.inner = ChainDrafter()
    guard.propose(requests(0))
    assert not guard.degraded


def test_a_failing_commit_is_contained() -> None:
    class BadCommit(ChainDrafter):
        def commit(self, slot: int, proposal: Proposal, acceptance: Acceptance) -> None:
            raise ValueError("cache out of step")

    inner = BadCommit()
    guard = GuardedDrafter(inner, VOCAB, cooldown=5.0, clock=Clock())
    proposal = guard.propose(requests(4))[0]
    guard.commit(4, proposal, Acceptance([0], [3]))
    assert guard.degraded and "cache out of step" in (guard.reason or "")
    assert inner.released == [4]


def test_a_failing_observation_is_contained_and_pauses_observing_too() -> None:
    inner, clock = ChainDrafter(), Clock()
    guard = GuardedDrafter(inner, VOCAB, cooldown=5.0, clock=clock)
    assert guard.observe(2, [1, 7, 3], 3, 0) == [0, None]
    inner.fail = True
    assert guard.observe(2, [1, 7, 3], 3, 0) is None
    assert guard.degraded and "observe failed" in (guard.reason or "") and inner.released == [2]
    inner.fail = False
    assert guard.observe(2, [1, 7, 3], 3, 0) is None  # paused: no estimates from a suspect drafter
    clock.now = 5.0
    assert guard.observe(2, [1, 7, 3], 3, 0) == [0, None]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="step_timeout"):
        GuardedDrafter(ChainDrafter(), VOCAB, step_timeout=0)


def test_paused_steps_do_not_flood_the_engine_log(caplog: pytest.LogCaptureFixture) -> None:
    inner, clock = ChainDrafter(), Clock()
    guard = GuardedDrafter(inner, VOCAB, cooldown=10.0, clock=clock)
    inner.fail = True
    engine_log = logging.getLogger("multiguess.engine.engine")
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            try:
                guard.propose(requests(0))
            except Exception as exc:  # what the engine does with it
                engine_log.warning("drafter failed, decoding this step without it: %s", exc)
    engine_lines = [r for r in caplog.records if r.name == engine_log.name]
    assert len(engine_lines) == 1 and "boom" in engine_lines[0].getMessage()
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1


def sampled(tokens: tuple[int, ...], parents: tuple[int, ...], rows: dict) -> Proposal:
    return Proposal(TokenTree(tokens, parents), rows)


def uniform() -> torch.Tensor:
    return torch.full((VOCAB,), 1.0 / VOCAB)


@pytest.mark.parametrize(
    ("proposal", "problem"),
    [
        (Proposal(TokenTree((3, VOCAB), (-1, 0))), "outside the vocabulary"),
        (Proposal(TokenTree((3, -1), (-1, 0))), "outside the vocabulary"),
        (Proposal(TokenTree((4, 7), (-1, 0))), "root is token 4"),
        (Proposal(TokenTree.chain([3, 5, 6])), "2 deep, the budget allows 1"),
        (Proposal(TokenTree((3, 5, 6), (-1, 0, 0))), "2 drafted nodes, the budget allows 1"),
        (sampled((3, 5), (-1, 0), {0: torch.ones(VOCAB + 1)}), "float row of 100 entries"),
        (sampled((3, 5), (-1, 0), {3: uniform()}), "outside the 2-node tree"),
        (sampled((3, 5), (-1, 0), {0: uniform() * float("nan")}), "could have been drawn"),
        (sampled((3, 5), (-1, 0), {0: -uniform()}), "could have been drawn"),
        (sampled((3, 5), (-1, 0), {0: torch.eye(VOCAB)[6]}), "could have been drawn"),  # child 5 has no mass
        ("not a proposal", "not a Proposal"),
    ],
)
def test_proposals_that_do_not_fit_the_request_are_named(proposal: object, problem: str) -> None:
    assert problem in (proposal_problem(requests(0)[0], proposal, VOCAB) or "")


def test_fitting_proposals_pass() -> None:
    request = DraftRequest(0, [1, 3], TreeBudget(2, 2, 3))
    tree = TokenTree((3, 5, 6, 8), (-1, 0, 0, 1))
    assert proposal_problem(request, Proposal(tree), VOCAB) is None
    assert proposal_problem(request, Proposal(tree, {0: uniform(), 1: torch.eye(VOCAB)[8]}), VOCAB) is None


def test_an_invalid_proposal_is_a_draft_failure_that_pauses_speculation() -> None:
    clock = Clock()

    class OutOfVocabulary(ChainDrafter):
        def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
            return [Proposal(TokenTree((r.token_ids[-1], VOCAB + 5), (-1, 0))) for r in requests]

    guard = GuardedDrafter(OutOfVocabulary(), VOCAB, cooldown=5.0, clock=clock)
    with pytest.raises(InvalidDraft, match="slot 0: a tree has token ids outside"):
        guard.propose(requests(0))
    assert guard.degraded and "invalid draft" in (guard.reason or "")
    with pytest.raises(DrafterUnavailable):
        guard.propose(requests(0))


def test_a_wrong_number_of_proposals_is_a_draft_failure() -> None:
    class Short(ChainDrafter):
        def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
            return super().propose(requests)[:-1]

    guard = GuardedDrafter(Short(), VOCAB, clock=Clock())
    with pytest.raises(InvalidDraft, match="1 proposals for 2 requests"):
        guard.propose(requests(0, 1))
