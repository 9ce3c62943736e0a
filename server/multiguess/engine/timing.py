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
import statistics
import time

import torch

from multiguess.engine.adaptive import ForwardCost, without_attention
from multiguess.engine.config import PREFILL_PAUSE_STEPS
from multiguess.engine.runner import NativeRunner
from multiguess.engine.tree import TokenTree

log = logging.getLogger(__name__)

MIN_PREFILL_CHUNK = 64  # a smaller chunk would pay a whole weight read for a few tokens
MAX_PREFILL_CHUNK = 8192


START_CONTEXTS = (64, 768)  # cached tokens a forward is timed after (measure_forward_cost)
ATTENTION_BATCH = 4  # sequences whose attention is timed together (measure_forward_cost)
ATTENTION_ROWS = (1, 2, 4)  # rows per sequence it is timed at


def measure_forward_cost(
    runner: NativeRunner, limit: int, rounds: int = 5, contexts: tuple[int, int] = START_CONTEXTS
) -> ForwardCost:
    """The target's forward time for 1, 2, 4, … ``limit`` tokens, and what attention over the
    cache adds to it, measured before any request runs (admission overwrites what it caches).

    The matmuls of a batch of single tokens cost about what a chain of as many does (one matmul
    over that many rows), so the curve times chains on slot 0 after the shorter of two
    ``contexts``. Attention does not: it grows with every sequence's context apart, shared only
    by that sequence's rows. So a batch of ``ATTENTION_BATCH`` sequences of 1, 2 and 4 rows each
    is timed after both contexts, and what the longer adds is fitted per sequence and row
    (``attention_slopes``); the curve is then the chains' time less their attention
    (``ForwardCost``). Without it attention is free, trees at long contexts are priced below
    what they cost, and the policy drafts trees that lose; one sequence's attention alone runs
    less evenly over the cores than a batch's, and prices a batch's too dear.

    The forwards take turns for ``rounds`` rounds and each keeps its fastest time, so a burst of
    load on a shared machine hits one sample, not one size (timing each size back to back
    misordered sizes and planned trees smaller than they pay); each is timed after an untimed
    forward of its own shape (``time_settled``); the curve is then made non-decreasing (more
    tokens never cost less). The measurements are in docs/ENGINE.md."""
    counts = sorted({min(2**i, limit) for i in range(limit.bit_length() + 1)})
    long = cache_context(runner, contexts[1], limit)
    short = min(contexts[0], long)
    batch = attention_batch(runner, long, limit)
    rows = [n for n in ATTENTION_ROWS if batch * n <= limit] or [1]
    chains = dict.fromkeys(counts, float("inf"))
    batches = dict.fromkeys(((n, c) for n in rows for c in (short, long)), float("inf"))
    for _ in range(rounds):
        for count in counts:
            chains[count] = min(chains[count], time_settled(runner, short, count))
        for n, context in batches:
            batches[n, context] = min(batches[n, context], time_settled(runner, context, n, batch))
    for slot in range(1, batch):
        runner.cache.truncate(slot, 0)
    per_sequence, per_row = 0.0, 0.0
    if long > short:
        added = [(batches[n, long] - batches[n, short]) / (batch * (long - short)) for n in rows]
        per_sequence, per_row = attention_slopes(rows, added)
    bare = (without_attention(s, (per_sequence + per_row * c) * short) for c, s in chains.items())
    seconds = list(itertools.accumulate(bare, max))
    log.info(
        "target forward ms by tokens: %s; attention per cached token: %.2f us a sequence + %.2f us a row",
        {c: round(s * 1000, 2) for c, s in zip(counts, seconds, strict=True)},
        per_sequence * 1e6,
        per_row * 1e6,
    )
    return ForwardCost(tuple(counts), tuple(seconds), per_sequence, per_row)


def attention_batch(runner: NativeRunner, context: int, limit: int) -> int:
    """How many sequences attention is timed on: up to ``ATTENTION_BATCH`` slots holding slot
    0's ``context`` (copied), as many as the cache has room for ``limit`` more tokens in."""
    cache, batch = runner.cache, 1
    while batch < min(ATTENTION_BATCH, cache.num_slots):
        cache.move(0, batch, context)
        if not cache.fits([(slot, context, context + limit) for slot in range(batch + 1)]):
            cache.truncate(batch, 0)
            break
        batch += 1
    return batch


def attention_slopes(rows: list[int], added: list[float]) -> tuple[float, float]:
    """The seconds each cached token adds to a forward, as ``per_sequence + per_row * rows``
    for a sequence of that many rows: the least-squares line through what it ``added`` at each
    count of ``rows``, neither part negative."""
    if len(rows) < 2:  # one count: a row's share cannot be told from the sequence's
        return max(0.0, added[0]), 0.0
    per_row = max(0.0, statistics.linear_regression(rows, added).slope)
    return max(0.0, statistics.fmean(added) - per_row * statistics.fmean(rows)), per_row


def cache_context(runner: NativeRunner, context: int, limit: int) -> int:
    """Fill slot 0 with ``context`` tokens (at most what leaves room for ``limit`` more), so
    timed forwards attend over a cached context as real ones do; returns its length."""
    context = max(0, min(context, runner.capacity - limit))
    if context:
        runner.forward_trees([0], [0], [TokenTree.chain([0] * context)], last_only=True)
    return context


def time_forward(
    runner: NativeRunner, context: int, count: int, batch: int = 1, last_only: bool = False
) -> float:
    """Seconds of one target forward of a chain of ``count`` tokens on each of slots 0 ..
    ``batch`` - 1, each after ``context`` cached tokens (``last_only``: the last position's
    logits only, as a prefill chunk computes)."""
    start = time.perf_counter()
    runner.forward_trees(
        list(range(batch)), [context] * batch, [TokenTree.chain([0] * count)] * batch, last_only=last_only
    )
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - start


def time_settled(runner: NativeRunner, context: int, count: int, batch: int = 1) -> float:
    """``time_forward`` of a forward run right after an untimed one of the same shape, as decode
    steps follow one another: one timed right after a wider forward runs slower, which priced
    small forwards too dear and every wider one's growth over them too cheap (docs/ENGINE.md)."""
    time_forward(runner, context, count, batch)
    return time_forward(runner, context, count, batch)


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
        best[count] = min(best[count], time_forward(runner, context, count, last_only=True))
        return best[count] <= pause_steps * best[1]

    for _ in range(rounds):
        fits(1)
        count = smallest * 2
        while count <= limit and fits(count):
            count *= 2
    chunk = max((c for c in best if c > smallest and best[c] <= pause_steps * best[1]), default=smallest)
    log.info("prefill chunk: %d tokens (a forward within %.1f ms)", chunk, pause_steps * best[1] * 1000)
    return chunk
