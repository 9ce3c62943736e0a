"""A static (pre-allocated) KV cache with one slot per running sequence.

Layout ``[layers, slots, kv_heads, capacity, head_dim]`` for keys and values. Verification
writes a whole tree after a sequence's prefix; compaction then moves the accepted path's
entries down to sit right after the prefix, in place, for every layer in one indexing op.
Nothing is reallocated per step and accepted tokens are never recomputed.
"""

from __future__ import annotations

import torch


class StaticKVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self._heads = torch.arange(num_kv_heads, device=device)

    @property
    def num_slots(self) -> int:
        return self.keys.shape[1]

    def write(
        self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store ``k``/``v`` ``[B, H, T, D]`` of sequence b at cache positions ``positions[b]``."""
        index = (slots[:, None, None], self._heads[None, :, None], positions[:, None, :])
        self.keys[layer].index_put_(index, k)
        self.values[layer].index_put_(index, v)

    @staticmethod
    def selector(slots: list[int]) -> slice | list[int]:
        """How to pick the batch's slots: a slice (reads are views) when they are one run."""
        if slots == list(range(slots[0], slots[0] + len(slots))):
            return slice(slots[0], slots[0] + len(slots))
        return slots

    def read(self, layer: int, selector: slice | list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, H, length, D]`` of the selected slots."""
        return self.keys[layer, selector, :, :length], self.values[layer, selector, :, :length]

    def compact(self, slot: int, start: int, nodes: list[int]) -> None:
        """Move the entries at ``start + nodes[i]`` to ``start + i`` in every layer."""
        if nodes == list(range(len(nodes))):
            return
        device = self.keys.device
        src = torch.tensor(nodes, device=device) + start
        dst = torch.arange(start, start + len(nodes), device=device)
        for cache in (self.keys, self.values):
            cache[:, slot, :, dst] = cache[:, slot, :, src]
