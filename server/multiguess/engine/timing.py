"""The target's forward time, measured once when the engine starts, before any request runs.

Two choices read it: the planner prices a tree by how much longer a forward of its nodes takes
(``measure_forward_cost``), and chunked prefill sizes its chunk by how long a chunk pauses the
running sequences (``measure_prefill_chunk``). Both time chains on slot 0 after a cached
context, which admission overwrites.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time

import torch

from multiguess.engine.adaptive import ForwardCost
from multiguess.engine.config import PREFILL_PAUSE_STEPS
from multiguess.engine.runner import NativeRunner
from multiguess.engine.tree import TokenTree

log = logging.getLogger(__name__)

MIN_PREFILL_CHUNK = 64  # a smaller chunk would pay a whole weight read for a few tokens
MAX_PREFILL_CHUNK = 8192


def measure_forward_cost(
    runner: NativeRunner, limit: int, rounds: int = 5, context: int = 256
) -> ForwardCost:
    """The target's forward time for 1, 2, 4, … ``limit`` tokens, as one chain on slot 0 after
    ``context`` cached tokens, before any request runs (admission overwrites it). A batch of
    single tokens costs about the same as a chain of as many: both are one matmul over that
    many rows, and attention over as many rows of context.

    The context matters: without it attention is free, trees are priced below what they cost,
    and the policy drafts trees that lose. The sizes take turns for ``rounds`` rounds and each
    keeps its fastest time, so a burst of load on a shared machine hits one sample, not one
    size (timing each size back to back misordered sizes and planned trees smaller than they
    pay); the curve is then made non-decreasing (more tokens never cost less). The measurements
    behind both choices are in docs/ENGINE.md."""
    counts = sorted({min(2**i, limit) for i in range(limit.bit_length() + 1)})
    context = cache_context(runner, context, limit)
    best = dict.fromkeys(counts, float("inf"))
    for _ in range(rounds):
        for count in counts:
            best[count] = min(best[count], time_chain(runner, context, count))
    seconds = list(itertools.accumulate((best[c] for c in counts), max))
    log.info(
        "target forward ms by tokens after %d cached: %s",
        context,
        {c: round(s * 1000, 2) for c, s in zip(counts, seconds, strict=True)},
    )
    return ForwardCost(tuple(counts), tuple(seconds))


def cache_context(runner: NativeRunner, context: int, limit: int) -> int:
    """Fill slot 0 with ``context`` tokens (at most what leaves room for ``limit`` more), so
    timed forwards attend over a cached context as real ones do; returns its length."""
    context = max(0, min(context, runner.capacity - limit))
    if context:
        runner.forward_trees([0], [0], [TokenTree.chain([0] * context)], last_only=True)
    return context


def time_chain(runner: NativeRunner, context: int, count: int, last_only: bool = False) -> float:
    """Seconds of one target forward of a chain of ``count`` tokens after ``context`` on slot 0
    (``last_only``: the last position's logits only, as a prefill chunk computes)."""
    start = time.perf_counter()
    runner.forward_trees([0], [context], [TokenTree.chain([0] * count)], last_only=last_only)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - start


def measure_prefill_chunk(
    runner: NativeRunner,
    limit: int,
    pause_steps: float = PREFILL_PAUSE_STEPS,
    rounds: int = 5,
    context: int = 256,
) -> int:
    """The chunk ``max_prefill_tokens="auto"`` prefills per step: the largest power of two
    (at least ``MIN_PREFILL_CHUNK``, at most ``limit``) whose forward after ``context`` cached
    tokens takes at most ``pause_steps`` one-token forwards. Each of ``rounds`` rounds times
    one token, then doubling chains until one is too slow by the fastest times so far: a burst
    of load on a shared machine slows one round's sample, not the answer, and the measurement
    costs a few chunks' time. On a CPU, where forward time grows with the tokens almost at
    once, this is a chunk of about a hundred tokens; on a GPU, whose forwards cost the same up
    to hundreds of tokens, thousands."""
    limit = max(1, min(limit, MAX_PREFILL_CHUNK))
    smallest = min(MIN_PREFILL_CHUNK, limit)
    context = cache_context(runner, context, limit)
    best: dict[int, float] = collections.defaultdict(lambda: float("inf"))

    def fits(count: int) -> bool:
        best[count] = min(best[count], time_chain(runner, context, count, last_only=True))
        return best[count] <= pause_steps * best[1]

    for _ in range(rounds):
        fits(1)
        count = smallest * 2
        while count <= limit and fits(count):
            count *= 2
    chunk = max((c for c in best if c > smallest and best[c] <= pause_steps * best[1]), default=smallest)
    log.info("prefill chunk: %d tokens (a forward within %.1f ms)", chunk, pause_steps * best[1] * 1000)
    return chunk
