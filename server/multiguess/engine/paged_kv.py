"""A paged KV cache: blocks of ``block_size`` positions, a block table per sequence slot.

The same interface as ``StaticKVCache`` (slots name sequences, positions are a sequence's own),
so the runner and everything above it reads and writes either one alike; what differs is where
a position lives. Storage is ``[layers, blocks, 2 * kv_heads, block_size, head_dim]`` (keys in
the first ``kv_heads``, values in the rest, as in the static cache), and slot s's position p is
row ``p % block_size`` of block ``tables[s][p // block_size]``. Memory then follows tokens:

- a write takes blocks as a sequence grows past its table (``locate``);
- a verification writes its whole tree after the prefix, and ``compact`` keeps the accepted
  rows and gives the blocks past them back, so a rejected branch holds nothing after its step;
- ``move`` shares a sequence's blocks with another slot by reference (a prefix reused from a
  running sequence costs no copy), and ``exchange`` swaps two tables: retiring a sequence
  copies no KV;
- a write into a block that another table also holds copies that block first (copy on write),
  so sharing never changes what another sequence reads;
- ``remember`` names a sequence's full blocks by content (``blocks.block_hashes``) and
  ``recall`` starts a new sequence from the blocks that already hold its prompt's first full
  blocks, wherever they are (held by a running sequence, or free but not yet reused).

Attention reads a slot's blocks gathered into contiguous keys and values (``read``): one gather
per layer, then the same attention calls as the static cache, so outputs are the same
arithmetic.
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Sequence as Tokens

import torch

from multiguess.engine.blocks import BlockPool, block_hashes, blocks_for

BLOCK_SIZE = 16  # vLLM's default: small enough that a sequence wastes little of its last block


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int = BLOCK_SIZE,
        num_blocks: int | None = None,
    ) -> None:
        """``num_blocks`` None: every slot can hold ``capacity`` positions at once (nothing can
        run out); fewer blocks (at least one sequence's capacity) serve more sequences than fit
        at full length, with ``fits`` saying when writes would not."""
        self.block_size = block_size
        self.max_blocks = blocks_for(capacity, block_size)  # per slot
        num_blocks = num_slots * self.max_blocks if num_blocks is None else num_blocks
        if num_blocks < self.max_blocks:
            raise ValueError(
                f"{num_blocks} KV blocks of {block_size} tokens hold less than one sequence of "
                f"{capacity} tokens ({self.max_blocks} blocks)"
            )
        shape = (num_layers, num_blocks, 2 * num_kv_heads, block_size, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.pool = BlockPool(num_blocks)
        self.tables: list[list[int]] = [[] for _ in range(num_slots)]
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.capacity = capacity
        self._heads = torch.arange(2 * num_kv_heads, device=device)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one cached position, every layer, keys and values."""
        layers, _, heads, _, dim = self.kv.shape
        return layers * heads * dim * self.kv.element_size()

    def held(self, slot: int) -> int:
        """Positions ``slot``'s table has room for (its blocks × the block size)."""
        return len(self.tables[slot]) * self.block_size

    # -- writes -------------------------------------------------------------------------------
    def locate(self, slots: list[int], starts: torch.Tensor, width: int) -> tuple:
        """Where a forward's ``width`` rows go (sequence b at ``starts[b] + 0..width-1``): blocks
        are taken for positions past each table, and shared ones written to are copied first."""
        starts = starts.cpu()
        for slot, start in zip(slots, starts.tolist(), strict=True):
            self._own(slot, start, start + width)
        positions = starts[:, None] + torch.arange(width)
        blocks = self._table_tensor(slots, blocks_for(int(positions.max()) + 1, self.block_size))
        device = self.kv.device
        ids = blocks.gather(1, positions // self.block_size).to(device)
        rows = (positions % self.block_size).to(device)
        return ids[:, None, :], self._heads[None, :, None], rows[:, None, :]

    def write(self, layer: int, where: tuple, kv: torch.Tensor) -> None:
        """Store keys and values ``[B, 2H, T, D]`` at ``where`` (from ``locate``)."""
        self.kv[layer].index_put_(where, kv)

    def fits(self, writes: list[tuple[int, int, int]]) -> bool:
        """Whether the pool has the blocks that writes to ``(slot, start, end)`` positions take:
        blocks past each table, and copies of shared blocks written to."""
        needed = 0
        for slot, start, end in writes:
            table = self.tables[slot]
            last = blocks_for(end, self.block_size)
            needed += max(0, last - len(table))
            needed += sum(self.pool.shared(b) for b in table[start // self.block_size : last])
        return needed <= self.pool.free

    def _own(self, slot: int, start: int, end: int) -> None:
        """``slot`` holds blocks for positions ``start..end-1`` that no other table holds and
        that answer for no content digest (they are about to change)."""
        if end > self.max_blocks * self.block_size:
            raise ValueError(f"sequence would exceed the cache capacity of {self.capacity} tokens")
        table, pool = self.tables[slot], self.pool
        first = start // self.block_size
        for i in range(first, min(len(table), blocks_for(end, self.block_size))):
            if pool.shared(table[i]):
                copy = pool.allocate()
                self.kv[:, copy] = self.kv[:, table[i]]
                pool.release(table[i])
                table[i] = copy
            else:
                pool.forget(table[i])
        while len(table) * self.block_size < end:
            table.append(pool.allocate())

    # -- reads --------------------------------------------------------------------------------
    def reader(self, slots: list[int], length: int) -> torch.Tensor:
        """The blocks the batch's first ``length`` positions are in, ``[B, blocks]``, found once per
        forward for every layer's ``read``."""
        return self._table_tensor(slots, blocks_for(length, self.block_size)).to(self.kv.device)

    def read(self, layer: int, blocks: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, H, length, D]`` of the slots whose ``blocks`` are given, gathered."""
        batch, count = blocks.shape
        _, _, heads, size, dim = self.kv.shape
        kv = self.kv[layer][blocks].transpose(1, 2).reshape(batch, heads, count * size, dim)[:, :, :length]
        return kv[:, : self.num_kv_heads], kv[:, self.num_kv_heads :]

    def _table_tensor(self, slots: list[int], count: int) -> torch.Tensor:
        """The first ``count`` blocks of each slot's table ``[B, count]`` (host); a short table is
        padded with its last block (positions past a sequence are masked, never seen)."""
        rows = []
        for slot in slots:
            table = self.tables[slot][:count]
            rows.append(table + [table[-1] if table else 0] * (count - len(table)))
        return torch.tensor(rows, dtype=torch.long)

    # -- moves --------------------------------------------------------------------------------
    def move(self, src: int, dst: int, length: int) -> None:
        """``dst`` holds ``src``'s first ``length`` entries: it shares ``src``'s blocks."""
        if src == dst:
            self.truncate(dst, length)
            return
        shared = self.tables[src][: blocks_for(length, self.block_size)]
        for block in shared:
            self.pool.hold(block)
        self.truncate(dst, 0)
        self.tables[dst] = list(shared)

    def exchange(self, a: int, b: int, length_a: int, length_b: int) -> None:
        """Slot ``a``'s first ``length_a`` entries go to slot ``b`` and ``b``'s first ``length_b``
        to ``a``: the tables change places, each cut to the entries that moved."""
        if a == b:
            return
        self.tables[a], self.tables[b] = self.tables[b], self.tables[a]
        self.truncate(a, length_b)
        self.truncate(b, length_a)

    def truncate(self, slot: int, length: int) -> None:
        """``slot`` keeps the blocks of its first ``length`` entries and gives the rest back."""
        table = self.tables[slot]
        keep = blocks_for(length, self.block_size)
        for block in table[keep:]:
            self.pool.release(block)
        del table[keep:]

    def compact(self, slot: int, start: int, nodes: list[int]) -> None:
        """Move the entries at ``start + nodes[i]`` to ``start + i`` in every layer; the blocks
        past them (the tree's rejected rows) go back to the pool."""
        self.compact_all([(slot, start, nodes)])

    def compact_all(self, moves: list[tuple[int, int, list[int]]]) -> None:
        """``compact`` of several ``(slot, start, nodes)`` at once: the batch's (block, row)
        places copied to the device in one tensor and moved by one indexing op."""
        places = []
        for slot, start, nodes in moves:
            if nodes == list(range(len(nodes))):
                continue
            self._own(slot, start, start + len(nodes))
            table = self.tables[slot]
            for i, node in enumerate(nodes):
                dst, src = start + i, start + node
                places.append((table[src // self.block_size], src % self.block_size))
                places.append((table[dst // self.block_size], dst % self.block_size))
        if places:
            src_blocks, src_rows, dst_blocks, dst_rows = (
                torch.tensor(places, device=self.kv.device).view(-1, 4).T
            )
            self.kv[:, dst_blocks, :, dst_rows] = self.kv[:, src_blocks, :, src_rows]
        for slot, start, nodes in moves:
            self.truncate(slot, start + len(nodes))

    # -- content ------------------------------------------------------------------------------
    def remember(self, slot: int, tokens: Tokens[int], scope: Hashable = None) -> None:
        """``slot`` holds the KV of ``tokens`` (its first entries): its full blocks are named by
        their content, so ``recall`` finds them for a prompt that starts the same way."""
        for block, digest in zip(
            self.tables[slot], block_hashes(tokens, self.block_size, scope), strict=False
        ):
            self.pool.register(block, digest)

    def recall(self, slot: int, tokens: Tokens[int], scope: Hashable, have: int) -> int:
        """The entries ``slot`` holds of ``tokens`` (``have`` so far): where the blocks named for
        more of ``tokens``'s full blocks are still held somewhere (by a running sequence, or
        free but not yet reused), ``slot`` starts from those, shared by reference."""
        found = []
        for digest in block_hashes(tokens, self.block_size, scope):
            block = self.pool.cached(digest)
            if block is None:
                break
            found.append(block)
        if len(found) * self.block_size <= have:
            return have
        for block in found:
            self.pool.hold(block)
        self.truncate(slot, 0)
        self.tables[slot] = found
        return len(found) * self.block_size
