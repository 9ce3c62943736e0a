"""One request cannot stall the rest: chunked prefill is on by default with a measured chunk,
prompt log-probabilities take bounded memory and are computed once per prompt, and a request's
samples take turns with other requests for the batch's slots (``engine/admission.py``).
Progress is counted in engine steps, not wall time."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from multiguess import SamplingParams
from multiguess.engine import engine as engine_module
from multiguess.engine.admission import next_admission, request_share
from multiguess.engine.config import EngineConfig
from multiguess.engine.engine import PROMPT_LOGPROB_ROWS, Engine
from multiguess.engine.paged_kv import PagedKVCache
from multiguess.engine.timing import (
    MIN_PREFILL_CHUNK,
    attention_batch,
    attention_slopes,
    cache_context,
    measure_forward_cost,
    measure_prefill_chunk,
)
from multiguess.models.loading import load_model

from tests.engine.test_lossless import random_prompts

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tiny_llama: Path) -> object:
    return load_model(str(tiny_llama), "float32")


def test_admission_gives_the_slot_to_the_request_holding_fewest() -> None:
    waiting = ["big", "big", "small", "other"]
    assert next_admission(waiting, Counter(big=2), share=4, blocked=set()) == 2
    assert next_admission(waiting, Counter(big=2, small=1), share=4, blocked=set()) == 3
    assert next_admission(waiting, Counter(), share=4, blocked=set()) == 0  # ties: queued first
    assert next_admission(waiting, Counter(), share=4, blocked={0, 1}) == 2
    assert next_admission(["big", "big"], Counter(big=4), share=4, blocked=set()) is None
    assert [request_share(b) for b in (1, 2, 7, 8)] == [1, 1, 4, 4]


def test_admission_looks_at_a_long_queue_of_one_request_once() -> None:
    """Thousands of one request's samples waiting (n large): admission reads the queue only up
    to each open group's first admissible sample, not every sample every step."""
    read = []

    def queue(groups: list[str]):
        for group in groups:
            read.append(group)
            yield group

    many = ["big"] * 10_000 + ["small"]
    assert next_admission(queue(many), Counter(big=1, small=1), 4, set(), open_groups=2) == 0
    assert len(read) == len(many)  # both open groups hold a slot: the scan must reach "small"
    read.clear()
    assert next_admission(queue(many), Counter(big=1, small=1), 4, set(), open_groups=1) == 0
    assert len(read) == 1
    read.clear()
    assert next_admission(queue(many), Counter(big=0), 4, set()) == 0  # holds nothing: none does better
    assert len(read) == 1


def test_chunked_prefill_is_on_by_default_and_interleaves(
    target: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no setting the chunk is measured (here the smallest, as if every forward past one
    token were too slow), and a long prompt is prefilled between the running stream's steps."""
    assert EngineConfig().max_prefill_tokens == "auto"
    monkeypatch.setattr(engine_module, "PREFILL_PAUSE_STEPS", 0)
    engine = Engine(target, None, EngineConfig(max_model_len=256, adaptive=False))  # type: ignore[arg-type]
    assert engine.config.max_prefill_tokens == MIN_PREFILL_CHUNK
    short, long = random_prompts(71, (4, 150))
    running = engine.add_request("running", short, SamplingParams(max_tokens=80, ignore_eos=True))
    engine.step()
    late = engine.add_request("long", long, GREEDY)
    gained, steps = [], 0
    while not late.output_ids:
        before = len(running.output_ids)
        engine.step()
        gained.append(len(running.output_ids) - before)
        steps += 1
    assert steps == math.ceil((len(long) - 1) / MIN_PREFILL_CHUNK)
    assert all(g >= 1 for g in gained)  # the running stream got a token between every two chunks


def test_the_measured_chunk_grows_with_the_pause(target: object) -> None:
    engine = Engine(target, None, EngineConfig(max_model_len=256, adaptive=False))  # type: ignore[arg-type]
    runner = engine.target
    assert measure_prefill_chunk(runner, 256, 0) == MIN_PREFILL_CHUNK
    assert measure_prefill_chunk(runner, 256, 1e9) == 256
    assert measure_prefill_chunk(runner, 8, 1e9) == 8


def test_attention_is_timed_on_sequences_that_hold_the_context(target: object) -> None:
    """The forward-cost measurement times attention on up to 4 slots, each holding slot 0's
    cached context, and fits non-negative costs per cached token onto a non-decreasing curve."""
    engine = Engine(target, None, EngineConfig(max_model_len=256, max_batch=4, adaptive=False))  # type: ignore[arg-type]
    runner = engine.target
    context = cache_context(runner, 100, 8)
    assert attention_batch(runner, context, 8) == 4
    kv = runner.cache.kv
    for slot in (1, 2, 3):
        assert torch.equal(kv[:, slot, :, :context], kv[:, 0, :, :context])
    assert kv[:, 1, :, :context].abs().sum() > 0
    cost = measure_forward_cost(runner, 8)
    assert cost.per_sequence >= 0 and cost.per_row >= 0
    assert list(cost.seconds) == sorted(cost.seconds) and cost.tokens == (1, 2, 4, 8)
    assert cost.seconds[0] > 0 and cost.growth(4, 2) >= 1  # a plain step is never free


def test_attention_is_timed_on_as_many_sequences_as_the_cache_has_room_for() -> None:
    shape = (2, 4, 2, 64, 8, torch.float32, torch.device("cpu"))
    paged = PagedKVCache(*shape, block_size=16, num_blocks=5)
    paged.locate([0], torch.tensor([0]), 40)  # slot 0 holds its context: 3 blocks, 2 left
    # Each copy shares those blocks, and the timed forwards' writes copy the third: two fit.
    assert attention_batch(SimpleNamespace(cache=paged), 40, 8) == 2  # type: ignore[arg-type]
    assert paged.tables[2] == []


def test_attention_slopes_fit_a_line_through_what_the_context_added() -> None:
    assert attention_slopes([1, 2, 4], [3.0, 4.0, 6.0]) == pytest.approx((2.0, 1.0))
    assert attention_slopes([1, 2, 4], [3.0, 2.0, 1.0]) == pytest.approx((2.0, 0.0))  # never negative
    assert attention_slopes([1], [3.0]) == (3.0, 0.0)


def test_prompt_logprobs_take_bounded_rows_and_equal_chunked_ones(
    target: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunking off, a long scored prompt is still computed ``PROMPT_LOGPROB_ROWS`` positions
    at a time, and its records equal those of a prefill in small chunks."""
    rows: list[int] = []
    compute = engine_module.prompt_logprobs

    def counted(logits: torch.Tensor, tokens: list[int], top: int) -> object:
        rows.append(logits.shape[0])
        return compute(logits, tokens, top)

    monkeypatch.setattr(engine_module, "prompt_logprobs", counted)
    (prompt,) = random_prompts(73, (400,))
    params = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=5)
    records = []
    for budget in (None, 16):
        engine = Engine(
            target, None, EngineConfig(max_model_len=512, adaptive=False, max_prefill_tokens=budget)
        )  # type: ignore[arg-type]
        seq = engine.add_request("r", prompt, params)
        while engine.has_unfinished():
            engine.step()
        records.append(seq.prompt_logprobs)
    assert max(rows) <= PROMPT_LOGPROB_ROWS and sum(rows) == 2 * (len(prompt) - 1)
    whole, chunked = records
    assert [r.token for r in whole] == [r.token for r in chunked] == prompt[1:]
    assert [r.logprob for r in whole] == pytest.approx([r.logprob for r in chunked], abs=1e-5)
    assert [[t for t, _ in r.top] for r in whole] == [[t for t, _ in r.top] for r in chunked]


def test_a_requests_samples_cannot_take_every_slot(target: object) -> None:
    """Eight long samples of one request on a batch of four hold at most two slots, so a small
    request behind them is admitted at once and finishes while they still run."""
    engine = Engine(target, None, EngineConfig(max_batch=4, max_model_len=256, adaptive=False))  # type: ignore[arg-type]
    big_prompt, small_prompt = random_prompts(79, (6, 5))
    endless = SamplingParams(max_tokens=200, ignore_eos=True)
    big = [engine.add_request(f"big-{i}", big_prompt, endless, group="big") for i in range(8)]
    engine.step()
    small = engine.add_request("small", small_prompt, GREEDY, group="small")
    steps = 0
    while not small.finished:
        engine.step()
        steps += 1
        assert Counter(s.group for s in engine.running)["big"] <= engine.config.request_slots == 2
    assert steps <= GREEDY.max_tokens
    assert not any(s.finished for s in big)


def test_samples_of_one_prompt_prefill_it_once(target: object) -> None:
    """The later samples of a request wait for the first to cache the shared prompt, then start
    from its KV; greedy, they decode what it does."""
    engine = Engine(target, None, EngineConfig(max_model_len=256, adaptive=False, max_prefill_tokens=16))  # type: ignore[arg-type]
    (prompt,) = random_prompts(83, (120,))
    seqs = [engine.add_request(f"r-{i}", prompt, GREEDY, group="r") for i in range(3)]
    while engine.has_unfinished():
        engine.step()
    assert seqs[0].cached_tokens == 0
    assert all(s.cached_tokens == len(prompt) - 1 for s in seqs[1:])
    assert seqs[0].output_ids == seqs[1].output_ids == seqs[2].output_ids
