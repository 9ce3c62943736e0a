"""The paged KV cache: block bookkeeping (reference counts, content digests, eviction order) and
the cache against the static one, entry for entry, under the operations the engine makes."""

from __future__ import annotations

import pytest
import torch
from multiguess.engine.blocks import BlockPool, OutOfBlocks, block_hashes, blocks_for
from multiguess.engine.kv_cache import StaticKVCache
from multiguess.engine.paged_kv import PagedKVCache


def test_blocks_for_rounds_up() -> None:
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]


def test_the_pool_counts_holders_and_runs_out() -> None:
    pool = BlockPool(2)
    a = pool.allocate()
    pool.hold(a)
    assert pool.shared(a) and pool.free == 1
    b = pool.allocate()
    with pytest.raises(OutOfBlocks):
        pool.allocate()
    pool.release(a)
    assert not pool.shared(a) and pool.free == 0
    pool.release(a)
    pool.release(b)
    assert pool.free == 2
    with pytest.raises(ValueError):
        pool.release(b)


def test_free_blocks_keep_their_content_until_reused_least_recent_first() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.register(a, b"A")
    pool.register(b, b"B")
    pool.release(a)
    pool.release(b)
    pool.release(c)  # no content: handed out before either
    assert pool.cached(b"A") == a and pool.cached(b"B") == b
    assert pool.allocate() == c
    assert pool.allocate() == a  # freed before b
    assert pool.cached(b"A") is None and pool.cached(b"B") == b
    pool.hold(b)  # found again: held, off the free list
    assert pool.free == 0 and pool.cached(b"B") == b


def test_a_digest_names_one_block_and_forgetting_drops_it() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, b"X")
    pool.register(b, b"X")  # a twin: the first stays the one found
    assert pool.cached(b"X") == a and pool.digest(b) is None
    pool.forget(a)
    assert pool.cached(b"X") is None


def test_block_hashes_chain_over_everything_before_and_the_scope() -> None:
    tokens = list(range(10))
    digests = block_hashes(tokens, 4)
    assert len(digests) == 2  # the partial last block has none
    assert block_hashes([*tokens[:4], 99, *tokens[5:]], 4)[0] == digests[0]
    assert block_hashes([*tokens[:4], 99, *tokens[5:]], 4)[1] != digests[1]
    assert block_hashes([99, *tokens[1:]], 4)[1] != digests[1]  # the chain carries earlier blocks
    assert block_hashes(tokens, 4, scope="tenant")[0] != digests[0]
    assert block_hashes(tokens[4:8], 4, start=digests[0]) == digests[1:]


LAYERS, KV_HEADS, DIM, CAPACITY = 2, 2, 3, 24


def caches(slots: int = 3, block_size: int = 4) -> tuple[StaticKVCache, PagedKVCache]:
    shape = (LAYERS, slots, KV_HEADS, CAPACITY, DIM, torch.float32, torch.device("cpu"))
    return StaticKVCache(*shape), PagedKVCache(*shape, block_size=block_size)


def write(
    cache: StaticKVCache | PagedKVCache, slots: list[int], starts: list[int], values: torch.Tensor
) -> None:
    """``values`` ``[B, 2H, T, D]`` into every layer (layer l gets values + l)."""
    where = cache.locate(slots, torch.tensor(starts), values.shape[2])
    for layer in range(LAYERS):
        cache.write(layer, where, values + layer)


def entries(cache: StaticKVCache | PagedKVCache, slots: list[int], length: int) -> torch.Tensor:
    reader = cache.reader(slots, length)
    return torch.stack([torch.cat(cache.read(layer, reader, length), 1) for layer in range(LAYERS)])


def rows(batch: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, 2 * KV_HEADS, width, DIM, generator=torch.Generator().manual_seed(seed))


def test_paged_reads_what_static_reads_through_writes_moves_and_compaction() -> None:
    static, paged = caches()
    for cache in (static, paged):
        write(cache, [0, 1], [0, 0], rows(2, 9, 0))  # two prompts
        write(cache, [0, 1], [9, 9], rows(2, 5, 1))  # a tree each
        cache.compact(0, 9, [0, 2, 3])
        cache.compact(1, 9, [0, 1])
        cache.move(0, 2, 10)  # a prefix shared by a third sequence
        write(cache, [2], [10], rows(1, 3, 2))  # it diverges: its shared block is copied first
        write(cache, [0], [12], rows(1, 2, 3))
    for slots, length in (([0], 14), ([1], 11), ([2], 13), ([0, 1, 2], 11)):
        assert torch.equal(entries(static, slots, length), entries(paged, slots, length))


def test_compaction_gives_rejected_rows_blocks_back() -> None:
    _, paged = caches(slots=1, block_size=4)
    write(paged, [0], [0], rows(1, 5, 0))
    write(paged, [0], [5], rows(1, 12, 1))  # a tree of 12 nodes: 17 positions, 5 blocks
    assert len(paged.tables[0]) == 5
    paged.compact(0, 5, [0, 7])
    assert len(paged.tables[0]) == 2 and paged.pool.held == 2


def test_sharing_holds_blocks_once_and_copies_on_write() -> None:
    _, paged = caches(block_size=4)
    write(paged, [0], [0], rows(1, 8, 0))
    paged.move(0, 1, 6)
    assert paged.tables[1] == paged.tables[0] and paged.pool.held == 2
    before = entries(paged, [0], 8)
    write(paged, [1], [6], rows(1, 2, 1))  # into the shared second block
    assert paged.tables[1][0] == paged.tables[0][0] and paged.tables[1][1] != paged.tables[0][1]
    assert torch.equal(entries(paged, [0], 8), before)
    assert paged.pool.held == 3


def test_an_exchange_swaps_tables_and_drops_what_does_not_move() -> None:
    _, paged = caches(block_size=4)
    write(paged, [0, 1], [0, 0], rows(2, 12, 0))
    a, b = list(paged.tables[0]), list(paged.tables[1])
    paged.exchange(0, 1, 12, 5)
    assert paged.tables[1] == a and paged.tables[0] == b[:2]
    assert paged.pool.held == 5


def test_recall_shares_the_blocks_named_for_a_prompt() -> None:
    _, paged = caches(block_size=4)
    prompt = list(range(11))
    write(paged, [0], [0], rows(1, 11, 0))
    paged.remember(0, prompt, scope="a")
    paged.truncate(0, 0)  # the sequence is gone; its full blocks stay free with their content
    assert paged.pool.held == 0
    assert paged.recall(1, prompt[:9], "b", 0) == 0  # another scope finds nothing
    assert paged.recall(1, [*prompt[:9], 50], "a", 8) == 8  # no more than the slot has
    assert paged.pool.held == 0
    assert paged.recall(1, [*prompt[:9], 50], "a", 3) == 8
    assert paged.pool.held == 2
    reference, _ = caches(block_size=4)
    write(reference, [0], [0], rows(1, 11, 0))
    assert torch.equal(entries(paged, [1], 8), entries(reference, [0], 8))


def test_writing_past_the_capacity_is_refused() -> None:
    _, paged = caches(slots=1)
    with pytest.raises(ValueError, match="capacity"):
        write(paged, [0], [20], rows(1, 8, 0))


def test_fits_counts_new_blocks_and_copies_of_shared_ones() -> None:
    shape = (LAYERS, 2, KV_HEADS, CAPACITY, DIM, torch.float32, torch.device("cpu"))
    paged = PagedKVCache(*shape, block_size=4, num_blocks=7)
    write(paged, [0], [0], rows(1, 10, 0))  # 3 blocks
    paged.move(0, 1, 10)  # shared: still 3 held, 4 free
    assert paged.fits([(1, 10, 12)])  # one copy of the shared third block
    assert paged.fits([(1, 10, 24)])  # that copy and 3 new blocks
    assert not paged.fits([(1, 10, 24), (0, 10, 13)])  # and one more copy: 5 > 4
    assert not paged.fits([(1, 4, 24)])  # copies of the second block too
    with pytest.raises(ValueError, match="less than one sequence"):
        PagedKVCache(*shape, block_size=4, num_blocks=5)
