"""Splitting a batch of token chains into forwards whose padded size stays within a budget."""

from __future__ import annotations


def padded_groups(lengths: list[int], budget: int, rooms: list[int] | None = None) -> list[list[int]]:
    """Indices of ``lengths``, in order, in runs whose padded size (longest × count) stays within
    ``budget`` tokens: one forward each. Chains of a forward are padded to its longest, so a
    batch of new prompts prefilled together would cost (in activations) a prefill of
    longest × count tokens; the memory plan measured one of ``budget``. A longer chain is a run
    of its own. ``rooms`` (cache positions left after each chain's start) keeps the padding of
    a short chain, written after it, inside its cache slot: a run is never longer than its
    members' least room."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    room = 0
    for i, n in enumerate(lengths):
        own = budget if rooms is None else rooms[i]
        if current and (max(longest, n) * (len(current) + 1) > budget or max(longest, n) > min(room, own)):
            groups.append(current)
            current, longest = [], 0
        room = own if not current else min(room, own)
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups


def prefill_chunks(remaining: list[int], budget: int | None) -> list[int]:
    """Prompt tokens each pending prefill computes this step, given the tokens each has left
    (in admission order) and the step's ``budget`` (None: no limit): the earliest take theirs
    first, so the oldest request reaches its first token soonest, and one step never prefills
    more than ``budget`` tokens however many prompts wait."""
    out = []
    left = budget
    for n in remaining:
        take = n if left is None else min(n, left)
        out.append(take)
        if left is not None:
            left -= take
    return out
