"""The engine over the paged KV cache (the torch backend's): token for token what plain decoding
over the CPU backend's static slots gives, with trees, a draft, chunked prefill, prefix sharing
and eviction, while blocks are shared, handed back and never leak."""

from __future__ import annotations

from pathlib import Path

import pytest
from multiguess import SamplingParams
from multiguess.engine.config import EngineConfig
from multiguess.engine.drafters.model import ModelDrafter
from multiguess.engine.engine import Engine
from multiguess.engine.paged_kv import PagedKVCache
from multiguess.models.loading import load_model

from tests.engine.test_prefix_cache import GREEDY, serve, shared_prompts, waves_of


@pytest.fixture(scope="module")
def pair(tiny_llama: Path, tiny_llama_draft: Path) -> tuple:
    return load_model(str(tiny_llama), "float32"), load_model(str(tiny_llama_draft), "float32")


def held_by_tables(cache: PagedKVCache) -> int:
    """Blocks some table lists, each counted once (shared ones too)."""
    return len({block for table in cache.tables for block in table})


def assert_consistent(cache: PagedKVCache) -> None:
    """Every held block is listed by as many tables as its count says, and no free one is."""
    listed = [block for table in cache.tables for block in table]
    assert cache.pool.held == held_by_tables(cache)
    for block in set(listed):
        assert cache.pool.refs[block] == listed.count(block)


@pytest.mark.parametrize(("chunk", "max_batch"), [(None, 4), (12, 2)], ids=["whole", "chunked-evicting"])
def test_paged_serving_equals_plain_static_decoding(pair: tuple, chunk: int | None, max_batch: int) -> None:
    target, draft = pair
    prompts = shared_prompts(21)
    plain_config = EngineConfig(max_model_len=256, adaptive=False, prefix_caching=False, max_batch=4)
    plain = serve(Engine(target, None, plain_config), waves_of(prompts))
    config = EngineConfig(
        3,
        3,
        max_batch=max_batch,
        max_model_len=256,
        adaptive=False,
        backend="torch",
        max_prefill_tokens=chunk,
    )
    engine = Engine(target, ModelDrafter(draft), config)
    caches = [engine.target.cache, engine.drafter.runner.cache]  # type: ignore[union-attr]
    assert all(isinstance(c, PagedKVCache) for c in caches)
    seqs = serve(engine, waves_of(prompts))
    assert [s.output_ids for s in seqs] == [s.output_ids for s in plain]
    assert sum(s.cached_tokens for s in seqs) > 100 and engine.totals.accepted_tokens > 0
    for cache in caches:
        assert_consistent(cache)


def test_blocks_follow_tokens_and_shared_prefixes_are_held_once(pair: tuple) -> None:
    """Two requests on one system prompt hold its blocks once while they run; each then holds
    only the blocks of its own tokens (the tree's rejected rows are given back every step)."""
    target, _ = pair
    prompts = shared_prompts(22)
    config = EngineConfig(3, 3, max_batch=2, max_model_len=256, adaptive=False, backend="torch")
    engine = Engine(target, None, config)
    cache = engine.target.cache
    assert isinstance(cache, PagedKVCache)
    first = engine.add_request("a", prompts[2], GREEDY)
    engine.step()
    second = engine.add_request("b", prompts[5], GREEDY)
    engine.step()
    assert second.cached_tokens >= 40
    size = cache.block_size
    shared = cache.tables[0][: 40 // size]
    assert shared == cache.tables[1][: 40 // size]
    for seq in (first, second):
        assert len(cache.tables[seq.slot]) == -(-seq.cache_len // size)
    assert cache.pool.held < len(cache.tables[0]) + len(cache.tables[1])
    assert_consistent(cache)


def test_a_prefix_no_slot_keeps_is_found_by_its_blocks(pair: tuple) -> None:
    """One slot: A's prompt is kept, then B's replaces it, and A's blocks are free but not yet
    reused. A sent again starts from those blocks (the static cache, which keeps prefixes only in
    free slots, computes it again), and decodes what it decodes afresh."""
    target, _ = pair
    a, _, _, _, b, *_ = shared_prompts(23)
    b = [(t + 1) % 60 + 4 for t in b]  # shares no first token with a
    runs = {}
    for backend in ("cpu", "torch"):
        config = EngineConfig(max_batch=1, max_model_len=256, adaptive=False, backend=backend)
        runs[backend] = serve(Engine(target, None, config), [[a], [b], [a]])
    assert [s.cached_tokens for s in runs["cpu"]] == [0, 0, 0]
    assert [s.cached_tokens for s in runs["torch"]] == [0, 0, (len(a) - 1) // 16 * 16]
    assert [s.output_ids for s in runs["torch"]] == [s.output_ids for s in runs["cpu"]]


def test_running_out_of_blocks_preempts_and_recomputes(pair: tuple) -> None:
    """A pool of a few sequences' worth of blocks for four slots: served one at a time, the
    free slots' kept prefixes give their blocks back when a new prompt needs them; served
    together, the most recently admitted sequences are preempted when blocks run out and
    computed again later (vLLM's recompute), target and draft alike. Every output is plain
    decoding's."""
    target, draft = pair
    prompts = [p for p in shared_prompts(24) if len(p) > 20][:4]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain_config = EngineConfig(max_model_len=128, adaptive=False, prefix_caching=False, max_batch=4)
    waves = [[p] for p in prompts] + [prompts]
    plain = serve(Engine(target, None, plain_config), waves, params)
    # 128 + the tree's slack is 10 blocks of 16; four sequences of ~90 tokens need 24.
    config = EngineConfig(3, 3, max_batch=4, max_model_len=128, adaptive=False, backend="torch", kv_blocks=14)
    engine = Engine(target, ModelDrafter(draft), config)
    seqs = serve(engine, waves, params)
    assert engine.preemptions > 0
    assert [s.output_ids for s in seqs] == [s.output_ids for s in plain]
    assert_consistent(engine.target.cache)  # type: ignore[arg-type]
