"""A static (pre-allocated) KV cache with one slot per running sequence.

Layout ``[layers, slots, 2 * kv_heads, capacity, head_dim]``: keys in the first ``kv_heads``,
values in the rest, so one write and one compaction cover both. Verification
writes a whole tree after a sequence's prefix; compaction then moves the accepted path's
entries down to sit right after the prefix, in place, for every layer in one indexing op.
Nothing is reallocated per step and accepted tokens are never recomputed. Scratch slots, past
the sequences' own, take writes that nothing may keep (a padded batch's padding rows).
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Sequence as Tokens
from typing import Any, Protocol

import torch


class KVCache(Protocol):
    """What the runner, backends and drafters call on a KV cache, whatever its layout (this
    module's static slots, ``paged_kv.PagedKVCache``'s blocks). Slots name sequences; positions
    are each sequence's own."""

    kv: torch.Tensor  # the storage
    num_slots: int
    num_kv_heads: int
    capacity: int  # positions one slot may hold
    block_size: int  # positions per block of storage; 0: none (a slot is one whole region)

    @property
    def bytes_per_token(self) -> int: ...

    def locate(self, slots: list[int], starts: torch.Tensor, width: int) -> tuple: ...

    def write(self, layer: int, where: tuple, kv: torch.Tensor) -> None: ...

    def reader(self, slots: list[int], length: int) -> Any: ...

    def read(self, layer: int, reader: Any, length: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def move(self, src: int, dst: int, length: int) -> None: ...

    def exchange(self, a: int, b: int, length_a: int, length_b: int) -> None: ...

    def compact(self, slot: int, start: int, nodes: list[int]) -> None: ...

    def compact_all(self, moves: list[tuple[int, int, list[int]]]) -> None: ...

    def truncate(self, slot: int, length: int) -> None:
        """``slot`` needs only its first ``length`` entries from now on."""
        ...

    def fits(self, writes: list[tuple[int, int, int]]) -> bool:
        """Whether writes to ``(slot, start, end)`` positions can all be made now."""
        ...

    def remember(self, slot: int, tokens: Tokens[int], scope: Hashable = None) -> None:
        """``slot``'s first entries are the KV of ``tokens`` (of cache ``scope``)."""
        ...

    def recall(self, slot: int, tokens: Tokens[int], scope: Hashable, have: int) -> int:
        """Entries ``slot`` holds of ``tokens`` after taking any longer run of them the cache
        still holds elsewhere than the ``have`` it holds already."""
        ...


class StaticKVCache:
    block_size = 0  # no blocks: each slot is its whole capacity

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        scratch_slots: int = 0,
    ) -> None:
        shape = (num_layers, num_slots + scratch_slots, 2 * num_kv_heads, capacity, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots  # the sequences' slots; scratch slots follow them
        self.num_kv_heads = num_kv_heads
        self.capacity = capacity
        self._heads = torch.arange(2 * num_kv_heads, device=device)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one cached position, every layer, keys and values."""
        layers, _, heads, _, dim = self.kv.shape
        return layers * heads * dim * self.kv.element_size()

    @property
    def scratch_slot(self) -> int:
        """The first scratch slot (an IndexError to write where none was reserved)."""
        if self.kv.shape[1] == self.num_slots:
            raise IndexError("this cache reserved no scratch slot")
        return self.num_slots

    def locate(self, slots: list[int], starts: torch.Tensor, width: int) -> tuple:
        """Where a forward's ``width`` rows go (sequence b at ``starts[b] + 0..width-1``), found once
        per forward for every layer's ``write``: one sequence is a plain slice, a batch an index."""
        if len(slots) == 1:
            start = int(starts[0])
            return (slots[0], slice(None), slice(start, start + width))
        device = self.kv.device
        positions = starts.to(device)[:, None] + torch.arange(width, device=device)
        return (
            torch.tensor(slots, device=device)[:, None, None],
            self._heads[None, :, None],
            positions[:, None, :],
        )

    def write(self, layer: int, where: tuple, kv: torch.Tensor) -> None:
        """Store keys and values ``[B, 2H, T, D]`` at ``where`` (from ``locate``)."""
        if isinstance(where[0], int):
            self.kv[layer][where] = kv[0]
        else:
            self.kv[layer].index_put_(where, kv)

    @staticmethod
    def selector(slots: list[int]) -> slice | list[int]:
        """How to pick the batch's slots: a slice (reads are views) when they are one run."""
        if slots == list(range(slots[0], slots[0] + len(slots))):
            return slice(slots[0], slots[0] + len(slots))
        return slots

    def reader(self, slots: list[int], length: int) -> slice | list[int]:
        """What every layer's ``read`` of one forward takes: the ``selector`` of its slots."""
        return self.selector(slots)

    def read(self, layer: int, selector: slice | list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, H, length, D]`` of the selected slots."""
        kv = self.kv[layer, selector, :, :length]
        return kv[:, : self.num_kv_heads], kv[:, self.num_kv_heads :]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` entries (every layer) to slot ``dst``."""
        self.kv[:, dst, :, :length] = self.kv[:, src, :, :length]

    def exchange(self, a: int, b: int, length_a: int, length_b: int) -> None:
        """Slot ``a``'s first ``length_a`` entries go to slot ``b`` and ``b``'s first ``length_b``
        to ``a`` (every layer); a length of 0 makes it a one-way move."""
        exchange_slots(self.kv.transpose(0, 1), a, b, length_a, length_b)

    def truncate(self, slot: int, length: int) -> None:
        """Nothing to give back: a slot's room is its own."""

    def fits(self, writes: list[tuple[int, int, int]]) -> bool:
        """Always: a slot's room is its own (``capacity`` bounds each sequence)."""
        return True

    def remember(self, slot: int, tokens: Tokens[int], scope: Hashable = None) -> None:
        """Nothing to name: kept prefixes are found by slot (``prefix_cache.PrefixIndex``)."""

    def recall(self, slot: int, tokens: Tokens[int], scope: Hashable, have: int) -> int:
        """Only what ``slot`` holds: no entry lives outside a slot."""
        return have

    def compact(self, slot: int, start: int, nodes: list[int]) -> None:
        """Move the entries at ``start + nodes[i]`` to ``start + i`` in every layer."""
        self.compact_all([(slot, start, nodes)])

    def compact_all(self, moves: list[tuple[int, int, list[int]]]) -> None:
        """``compact`` of several ``(slot, start, nodes)`` at once: one index copied to the
        device and one indexing op for a whole batch's accepted paths."""
        places = [
            (slot, start + i, start + node)
            for slot, start, nodes in moves
            if nodes != list(range(len(nodes)))
            for i, node in enumerate(nodes)
        ]
        if not places:
            return
        slots, dst, src = torch.tensor(places, device=self.kv.device).T
        self.kv[:, slots, :, dst] = self.kv[:, slots, :, src]


def exchange_slots(kv: torch.Tensor, a: int, b: int, length_a: int, length_b: int) -> None:
    """Swap the leading entries of slots ``a`` and ``b`` of ``kv`` ``[slots, ..., positions, dim]``
    in place (a prefix kept in a free slot changes places with a sequence that moves)."""
    if a == b:
        return
    saved = kv[b, ..., :length_b, :].clone()
    kv[b, ..., :length_a, :] = kv[a, ..., :length_a, :]
    kv[a, ..., :length_b, :] = saved
