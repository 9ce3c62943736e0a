"""Fixed-size KV blocks: which are free, who holds each, and what the full ones contain.

A paged KV cache (``engine/paged_kv.py``) stores every sequence's keys and values in blocks of
``block_size`` positions, listed in order by the sequence's block table. This module is the
bookkeeping alone, with no tensors:

- ``BlockPool`` hands out block ids and counts how many tables hold each. A block no table holds
  is free; a free block that still has a content hash keeps its KV until the pool needs it
  again (least recently freed first, vLLM's eviction order), so it can be found and shared.
- ``block_hashes`` names each full block by its tokens and every token before it (a chain of
  digests, seeded by the request's cache scope, as vLLM hashes ``cache_salt`` into the first
  block): equal digests mean equal KV, so a block is shared by reference instead of copied.
- ``blocks_for`` is how many blocks hold a number of positions.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable
from collections.abc import Sequence as Tokens

from multiguess.errors import MultiguessError


class OutOfBlocks(MultiguessError):
    """Every block is held by some table: nothing is free to allocate."""


def blocks_for(positions: int, block_size: int) -> int:
    return -(-positions // block_size)


def block_hashes(
    tokens: Tokens[int], block_size: int, scope: Hashable = None, start: bytes = b""
) -> list[bytes]:
    """The digest of each full block of ``tokens``: block i's covers ``tokens[: (i + 1) *
    block_size]`` and ``scope``, so two prompts share a block's digest only when they share
    everything up to its end, within one scope. ``start`` continues a chain (the digest of the
    block before the first one given); a partial last block has none."""
    digests = []
    previous = start or hashlib.sha256(repr(scope).encode()).digest()
    for end in range(block_size, len(tokens) + 1, block_size):
        chunk = ",".join(map(str, tokens[end - block_size : end])).encode()
        previous = hashlib.sha256(previous + chunk).digest()
        digests.append(previous)
    return digests


class BlockPool:
    """``num_blocks`` block ids with reference counts and the content digests of full blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        # Free blocks, the next to hand out first: digest-less ones ahead, then the least
        # recently freed of those that keep content.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._digest: dict[int, bytes] = {}
        self._by_digest: dict[bytes, int] = {}

    @property
    def free(self) -> int:
        """Blocks available to ``allocate`` (free ones keeping content included)."""
        return len(self._free)

    @property
    def held(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        """A block for new content, held once; its previous content (if it kept any) is forgotten."""
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        block, _ = self._free.popitem(last=False)
        self.forget(block)
        self.refs[block] = 1
        return block

    def hold(self, block: int) -> None:
        """One more table holds ``block`` (taken off the free list if it was free)."""
        if self.refs[block] == 0:
            del self._free[block]
        self.refs[block] += 1

    def release(self, block: int) -> None:
        """A table gives ``block`` up; the last one frees it (keeping its content while it has a
        digest, to be found by ``cached`` until allocated again)."""
        if self.refs[block] <= 0:
            raise ValueError(f"block {block} is not held")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self._free[block] = None
            if block not in self._digest:
                self._free.move_to_end(block, last=False)

    def shared(self, block: int) -> bool:
        return self.refs[block] > 1

    def register(self, block: int, digest: bytes) -> None:
        """``block`` holds the content ``digest`` names (a full block). The first block
        registered under a digest is the one found; a later twin keeps no digest."""
        if block in self._digest or digest in self._by_digest:
            return
        self._digest[block] = digest
        self._by_digest[digest] = block

    def digest(self, block: int) -> bytes | None:
        return self._digest.get(block)

    def forget(self, block: int) -> None:
        """``block``'s content is about to change: it no longer answers for its digest."""
        digest = self._digest.pop(block, None)
        if digest is not None:
            del self._by_digest[digest]

    def cached(self, digest: bytes) -> int | None:
        """The block holding the content ``digest`` names, held or free; None if none does."""
        return self._by_digest.get(digest)
