"""The draft service keeps its sessions in step with a local ModelDrafter, message by message.

Only the new tokens and the accepted path travel, so these tests compare every proposed tree
with the local drafter fed whole sequences: equal trees mean the server's draft cache holds
exactly what the local one does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multiguess.engine.acceptance import Acceptance
from multiguess.engine.drafter import DraftRequest, TreeBudget
from multiguess.engine.loaded_model import LoadedModel
from multiguess.models.loading import load_model
from multiguess.remote.protocol import Commit, Drafted, Failed, Request, Resend, Sampling, StepMessage
from multiguess.remote.service import DraftService

from tests.drafters import model_drafter

BUDGET = TreeBudget(3, 3, 8)


@pytest.fixture(scope="module")
def draft(tiny_llama_draft: Path) -> LoadedModel:
    return load_model(str(tiny_llama_draft), dtype="float32")


def service(draft: LoadedModel, sessions: int = 4) -> DraftService:
    drafter = model_drafter(draft, sessions, 128, wire_exact=True)
    return DraftService(drafter, sessions, max_model_len=100, idle_seconds=60)


def deepest_path(tree_parents: tuple[int, ...]) -> list[int]:
    """A deterministic 'acceptance': follow each node's last child down to a leaf."""
    path = [0]
    while True:
        kids = [i for i, p in enumerate(tree_parents) if p == path[-1]]
        if not kids:
            return path
        path.append(kids[-1])


def drafted(result: object) -> Drafted:
    assert isinstance(result, Drafted), result
    return result


def test_incremental_steps_match_the_local_drafter(draft: LoadedModel) -> None:
    local = model_drafter(draft, 1, 128)
    remote = service(draft)
    sequence = [5, 9, 11, 40, 7]
    sent, commit = 0, ()
    for step in range(6):
        mine = local.propose([DraftRequest(0, sequence, BUDGET)])[0]
        message = StepMessage(commits=commit, requests=(Request(0, sent, tuple(sequence[sent:]), BUDGET),))
        replies, _ = remote.handle([("target-a", message)])
        theirs = drafted(replies[0].results[0])
        assert theirs.tree == mine.tree, f"step {step}"
        path = deepest_path(mine.tree.parents)
        local.commit(0, mine, Acceptance(path, []))
        sent, commit = len(sequence), (Commit(0, tuple(path)),)
        sequence = sequence + [mine.tree.tokens[n] for n in path[1:]] + [4 + step]
        if step:  # after the first step only the path and bonus token travel
            assert len(message.requests[0].tokens) <= BUDGET.depth + 1
    session = remote.sessions.get(("target-a", 0))
    assert session is not None and remote.drafter.cached[session.slot] == len(session.tokens)


def test_evicted_session_is_resent_and_drafts_the_same(draft: LoadedModel) -> None:
    remote = service(draft, sessions=1)
    first = (5, 9, 11, 40)
    (reply,), _ = remote.handle([("a", StepMessage(requests=(Request(0, 0, first, BUDGET),)))])
    tree = drafted(reply.results[0]).tree
    (other,), events = remote.handle([("b", StepMessage(requests=(Request(0, 0, (6, 7), BUDGET),)))])
    assert events.evicted_lru == 1 and isinstance(other.results[0], Drafted)
    (again,), events = remote.handle([("a", StepMessage(requests=(Request(0, 4, (12,), BUDGET),)))])
    assert again.results == [Resend(0)] and events.resends == 1
    (full,), _ = remote.handle([("a", StepMessage(requests=(Request(0, 0, first, BUDGET),)))])
    assert drafted(full.results[0]).tree == tree


def test_a_diverged_sequence_is_drafted_from_its_own_tokens(draft: LoadedModel) -> None:
    """A client that resends an older start with other tokens gets what a fresh cache gives."""
    remote, fresh = service(draft), service(draft)
    remote.handle([("a", StepMessage(requests=(Request(0, 0, (5, 9, 11, 40), BUDGET),)))])
    (reply,), _ = remote.handle([("a", StepMessage(requests=(Request(0, 2, (30, 31), BUDGET),)))])
    (expected,), _ = fresh.handle([("a", StepMessage(requests=(Request(0, 0, (5, 9, 30, 31), BUDGET),)))])
    assert drafted(reply.results[0]).tree == drafted(expected.results[0]).tree


def test_two_clients_in_one_batch(draft: LoadedModel) -> None:
    remote = service(draft)
    batch = [
        ("a", StepMessage(requests=(Request(0, 0, (5, 9), BUDGET), Request(1, 0, (7, 8, 9), BUDGET)))),
        ("b", StepMessage(requests=(Request(0, 0, (5, 9), BUDGET),))),
    ]
    replies, events = remote.handle(batch)
    assert events.drafted == 3 and len(remote.sessions) == 3
    assert drafted(replies[0].results[0]).tree == drafted(replies[1].results[0]).tree


def test_bad_requests_fail_alone(draft: LoadedModel) -> None:
    remote = service(draft)
    message = StepMessage(
        requests=(
            Request(0, 0, (5, 9999), BUDGET),
            Request(1, 0, tuple([5] * 101), BUDGET),
            Request(2, 0, (5, 9), TreeBudget(8, 8, 16)),
            Request(3, 0, (5, 9), BUDGET),
            Request(3, 0, (5, 9, 10), BUDGET),
            Request(4, 0, (5, 9), TreeBudget(3, 0, 8)),
        )
    )
    (reply,), _ = remote.handle([("a", message)])
    assert isinstance(reply.results[0], Failed) and "vocabulary" in reply.results[0].reason
    assert isinstance(reply.results[1], Failed) and "max model length" in reply.results[1].reason
    assert isinstance(reply.results[2], Failed) and "tree budget" in reply.results[2].reason
    assert isinstance(reply.results[3], Drafted)
    assert isinstance(reply.results[4], Failed) and "twice" in reply.results[4].reason
    assert isinstance(reply.results[5], Failed) and "depth >= 1" in reply.results[5].reason


def test_sampled_rows_are_what_children_were_drawn_from(draft: LoadedModel) -> None:
    remote = service(draft)
    sampling = Sampling(0.8, 0.95, 0, seed=1234)
    message = StepMessage(requests=(Request(0, 0, (5, 9, 11), BUDGET, sampling),))
    (reply,), _ = remote.handle([("a", message)])
    result = drafted(reply.results[0])
    (again,), _ = service(draft).handle([("a", message)])
    assert drafted(again.results[0]).tree == result.tree  # the seed decides the draws
    children = result.tree.children()
    assert set(result.draft_probs) == {n for n, kids in enumerate(children) if kids}
    for node, q in result.draft_probs.items():
        assert q.dtype == torch.float32 and abs(float(q.double().sum()) - 1) < 1e-5
        assert all(q[result.tree.tokens[c]] > 0 for c in children[node])


def test_a_request_that_fails_the_batched_draft_fails_alone(
    draft: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should a batched propose fail anyway, each request is drafted alone from its whole
    sequence: the others get the tree they would have got, only the culprit fails."""
    remote = service(draft)
    batched = remote.drafter.propose

    def poisoned(requests: list[DraftRequest]) -> list:
        if any(13 in r.token_ids for r in requests):
            raise RuntimeError("a request the drafter cannot handle")
        return batched(requests)

    first = StepMessage(requests=(Request(0, 0, (5, 9, 11), BUDGET),))
    (warm,), _ = remote.handle([("a", first)])
    path = deepest_path(drafted(warm.results[0]).tree.parents)
    monkeypatch.setattr(remote.drafter, "propose", poisoned)
    tokens = tuple(drafted(warm.results[0]).tree.tokens[n] for n in path[1:])
    good = StepMessage(commits=(Commit(0, tuple(path)),), requests=(Request(0, 3, (*tokens, 7), BUDGET),))
    bad = StepMessage(requests=(Request(0, 0, (5, 13), BUDGET),))
    (mine, theirs), _ = remote.handle([("a", good), ("b", bad)])
    assert isinstance(theirs.results[0], Failed) and "cannot handle" in theirs.results[0].reason
    alone = model_drafter(draft, 1, 128).propose([DraftRequest(0, [5, 9, 11, *tokens, 7], BUDGET)])
    assert drafted(mine.results[0]).tree == alone[0].tree
