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


def request_share(max_batch: int) -> int:
    """The most slots one request's samples hold at once: half the batch, rounded up."""
    return max(1, (max_batch + 1) // 2)


def next_admission(waiting: list[str], held: Counter[str], share: int, blocked: set[int]) -> int | None:
    """The index in ``waiting`` (each entry a sample's group, in queue order) that takes the
    next free slot, given the slots each group ``held`` and the per-group ``share``; entries in
    ``blocked`` are skipped this time. None when no waiting sample may start."""
    best: tuple[int, int] | None = None
    for i, group in enumerate(waiting):
        if i in blocked or held[group] >= share:
            continue
        if best is None or held[group] < best[0]:
            best = (held[group], i)
    return None if best is None else best[1]
