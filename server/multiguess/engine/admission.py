"""Which waiting sample takes a free batch slot: fair turns between requests.

A request's samples (``n``, ``best_of``, several prompts) share a group. Without turns, a
request with as many samples as the batch has slots takes every slot, and a request behind it
waits until one of them finishes, however long they generate. So a free slot goes to the
waiting group that holds the fewest slots (round-robin by request; ties to the one queued
first), and no group holds more than its share of the batch at once: its other samples wait
for its own to finish, and the other slots stay open to the requests behind it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Iterable


def request_share(max_batch: int) -> int:
    """The most slots one request's samples hold at once: half the batch, rounded up."""
    return max(1, (max_batch + 1) // 2)


def next_admission(
    waiting: Iterable[str],
    held: Counter[str],
    share: int,
    blocked: Container[int],
    open_groups: int | None = None,
) -> int | None:
    """The index in ``waiting`` (each entry a sample's group, in queue order) that takes the
    next free slot, given the slots each group ``held`` and the per-group ``share``; entries in
    ``blocked`` are skipped this time. None when no waiting sample may start. The scan stops at
    a group holding nothing (none can do better) or, given ``open_groups`` (how many groups
    are under their share), once each of them has shown its first admissible entry, so a long
    queue of one request's samples costs one look, not one per sample."""
    best: tuple[int, int] | None = None
    decided: set[str] = set()
    for i, group in enumerate(waiting):
        if group in decided or held[group] >= share or i in blocked:
            continue
        decided.add(group)
        if best is None or held[group] < best[0]:
            best = (held[group], i)
            if best[0] == 0:
                break
        if open_groups is not None and len(decided) == open_groups:
            break
    return None if best is None else best[1]
