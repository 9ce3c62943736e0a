"""Prefix reuse: where a new prompt's leading tokens already have KV, and how to get it.

The caches hold one sequence per slot, running sequences in slots ``0..n-1``. A finished
sequence leaves its tokens and KV in its (now free) slot as a *kept prefix*; free slots are
the prefix store, so it takes no memory of its own and an entry lives until a new sequence
needs its slot (least recently used first). A new sequence always runs in the lowest free
slot; its prompt is matched against every kept prefix and every running sequence (a system
prompt shared by requests served at the same time), and the longest match is brought into
its slot without recomputing it:

- its own slot's kept prefix: used in place;
- another free slot's: the two slots exchange contents, so the slot's own entry stays kept;
- a running sequence's: its first tokens' KV are copied; the slot's own entry moves to the
  free slot holding the least recently used one (or is dropped, when it is that one).

At most ``len(prompt) - 1`` tokens are reused: the last prompt token is the root of the first
tree and gets its logits from the first verification, as without reuse.

Every entry and running sequence carries its request's *cache scope* (``SamplingParams.
cache_scope``: tenant and ``cache_salt``), and a prompt matches only those of an equal scope.
A hit is faster and shows in ``cached_tokens``, so sharing across scopes would tell one tenant
what another sent; vLLM gets the same effect by hashing ``cache_salt`` into the first block's
hash. Eviction stays global: a slot is a slot, whoever filled it.

With a handful of slots, matching every entry is cheaper than keeping a hash of token blocks
(vLLM) or a radix tree (SGLang): those pay off over thousands of paged blocks; this store has
one entry per free slot.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Mapping
from collections.abc import Sequence as Tokens
from dataclasses import dataclass


def common_prefix(a: Tokens[int], b: Tokens[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share: a bisection over slice comparisons, so
    the work runs in C rather than a Python loop over every token (lists and tuples alike)."""
    a, b = list(a), list(b)
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixIndex:
    """The tokens kept in free slots, and when each was stored. An entry that is reused is
    consumed (its slot runs the new sequence, which offers the same prefix while it runs and
    is kept again when it finishes), so the time stored is the time last used."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[int, ...]] = {}
        self._used: dict[int, int] = {}
        self._scope: dict[int, Hashable] = {}
        self._clock = itertools.count()

    def kept(self, slot: int) -> tuple[int, ...]:
        return self._kept.get(slot, ())

    def reusable(self, slot: int, scope: Hashable) -> tuple[int, ...]:
        """What ``slot`` keeps, if it was kept under ``scope``; nothing otherwise."""
        return self.kept(slot) if slot in self._kept and self._scope[slot] == scope else ()

    def keep(self, slot: int, tokens: Tokens[int], scope: Hashable = None) -> None:
        """``slot`` now holds the KV of ``tokens`` (none: the slot keeps nothing), reusable
        under ``scope`` only."""
        self.drop(slot)
        if tokens:
            self._kept[slot] = tuple(tokens)
            self._used[slot] = next(self._clock)
            self._scope[slot] = scope

    def drop(self, slot: int) -> None:
        self._kept.pop(slot, None)
        self._used.pop(slot, None)
        self._scope.pop(slot, None)

    def swap(self, a: int, b: int) -> None:
        """Slots ``a`` and ``b`` exchanged their contents."""
        for state in (self._kept, self._used, self._scope):
            swap_keys(state, a, b)

    def oldest(self, slots: Iterable[int]) -> int | None:
        """Of ``slots``, one that keeps nothing, else the least recently used; None if none."""
        candidates = list(slots)
        empty = [s for s in candidates if s not in self._kept]
        if empty:
            return empty[0]
        return min(candidates, key=self._used.__getitem__, default=None)

    def used_before(self, a: int, b: int) -> bool:
        """Whether ``a``'s entry was stored before ``b``'s."""
        return self._used[a] < self._used[b]


def swap_keys(state: dict, a: int, b: int) -> None:
    """Exchange what ``state`` holds under slots ``a`` and ``b`` (either may hold nothing)."""
    held_a, held_b = state.pop(a, None), state.pop(b, None)
    if held_a is not None:
        state[b] = held_a
    if held_b is not None:
        state[a] = held_b


@dataclass(frozen=True)
class Reuse:
    """How a new sequence in ``slot`` gets its first ``length`` prompt tokens' KV.

    First, when ``swap_with`` is set, ``slot`` and that free slot exchange contents (a kept
    source comes in, or the slot's own entry goes out to the least recently used one's place);
    then, when ``copy_from`` is set, that running sequence's first ``length`` entries are copied
    into ``slot``. Neither: the slot's own kept prefix is used in place (or nothing is)."""

    slot: int
    length: int
    swap_with: int | None = None
    copy_from: int | None = None

    @property
    def source(self) -> int:
        """The slot that holds the reused KV once the swap is done."""
        return self.copy_from if self.copy_from is not None else self.slot


def plan_reuse(
    prompt: Tokens[int],
    slot: int,
    free: Iterable[int],
    running: Mapping[int, tuple[Hashable, Tokens[int]]],
    index: PrefixIndex,
    scope: Hashable = None,
) -> Reuse:
    """The longest reuse for ``prompt`` (a request of cache ``scope``) starting in free ``slot``,
    from the prefixes kept in the ``free`` slots (``slot`` and those above it) or the ``running``
    sequences' cached tokens (by slot: their scope and tokens), of ``scope`` only. Ties go to
    the slot's own entry (no copy), then to kept entries (a swap keeps both)."""
    free = [s for s in free if s != slot]
    limit = len(prompt) - 1
    kept = [(s, index.reusable(s, scope)) for s in (slot, *free)]
    shared = [(s, tokens) for s, (owner, tokens) in running.items() if owner == scope]
    best, length = slot, 0
    for source, tokens in [*kept, *shared]:
        matched = min(common_prefix(prompt, tokens), limit)
        if matched > length:
            best, length = source, matched
    if length and best == slot:
        return Reuse(slot, length)
    if length and best in free:
        return Reuse(slot, length, swap_with=best)
    copy_from = best if length else None
    victim = None
    if index.kept(slot):  # keep the slot's own entry, in the place of the least valuable one
        victim = index.oldest(free)
        if victim is not None and index.kept(victim) and index.used_before(slot, victim):
            victim = None  # the slot's own entry is the least recently used: drop it
    return Reuse(slot, length, swap_with=victim, copy_from=copy_from)
