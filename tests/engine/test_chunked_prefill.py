"""Chunked prefill (``max_prefill_tokens``): a prompt prefilled over several steps gives the
same caches, target and draft, and the same tokens as one prefilled whole, with speculation
on, on the CPU kernels (bf16, fp32) and the torch backend; running sequences keep decoding
between its chunks; prompt log-probabilities are the model's own."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from multiguess import LLM, SamplingParams
from multiguess.engine import engine as engine_module
from multiguess.engine.config import IDLE_PREFILL_CHUNKS, EngineConfig
from multiguess.engine.drafters.model import ModelDrafter
from multiguess.engine.engine import Engine
from multiguess.engine.sequence import Sequence
from multiguess.models.loading import load_model
from transformers import AutoModelForCausalLM

from tests.engine.test_bf16_kernels import needs_kernel
from tests.engine.test_eagle3 import plain_outputs, saved_head, small_vocab_target  # noqa: F401
from tests.engine.test_lossless import random_prompts

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def staggered(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Half the prompts first, the rest two steps later: prefills meet running sequences."""
    half = len(prompts) // 2
    seqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts[:half])]
    for _ in range(2):
        engine.step()
    seqs += [engine.add_request(f"r{i + half}", p, params) for i, p in enumerate(prompts[half:])]
    while engine.has_unfinished():
        engine.step()
    return [s.output_ids for s in seqs]


def arrival_beside_a_stream(
    engine: Engine, stream: list[int], prompt: list[int], step: Callable[[], object] | None = None
) -> tuple[Sequence, Sequence, int, int]:
    """A greedy stream of ``stream`` decodes a step, then ``prompt`` arrives: the two sequences,
    the steps (``step``, by default ``engine.step``) until the arrival's first token, and the
    tokens the stream decoded meanwhile."""
    running = engine.add_request("running", stream, SamplingParams(max_tokens=80, ignore_eos=True))
    engine.step()
    arrived = engine.add_request("arrived", prompt, GREEDY)
    before, steps = len(running.output_ids), 0
    while not arrived.output_ids:
        (step or engine.step)()
        steps += 1
    return running, arrived, steps, len(running.output_ids) - before


CASES = [
    pytest.param("float32", "cpu", id="fp32-cpu"),
    pytest.param("bfloat16", "cpu", id="bf16-kernels", marks=needs_kernel),
    pytest.param("float32", "torch", id="fp32-torch"),
]


@pytest.mark.parametrize(("dtype", "backend"), CASES)
def test_chunked_prefill_decodes_what_a_whole_prefill_does(
    tiny_llama: Path, tiny_llama_draft: Path, dtype: str, backend: str
) -> None:
    target, draft = load_model(str(tiny_llama), dtype), load_model(str(tiny_llama_draft), dtype)
    prompts = random_prompts(41, (90, 1, 33, 7, 64, 20))
    common = dict(max_batch=4, max_model_len=160, adaptive=False, backend=backend)
    plain = staggered(Engine(target, None, EngineConfig(**common)), prompts, GREEDY)  # type: ignore[arg-type]
    whole = Engine(target, ModelDrafter(draft), EngineConfig(3, 3, **common))  # type: ignore[arg-type]
    assert staggered(whole, prompts, GREEDY) == plain
    for budget in (5, 16):
        chunked = Engine(target, ModelDrafter(draft), EngineConfig(3, 3, max_prefill_tokens=budget, **common))  # type: ignore[arg-type]
        assert staggered(chunked, prompts, GREEDY) == plain, budget
        assert chunked.totals.accepted_tokens > 0
        assert chunked.totals.fallback_steps == 0


def test_chunks_fill_the_caches_a_whole_prefill_fills(tiny_llama: Path, tiny_llama_draft: Path) -> None:
    """Target and draft KV of the prompt, entry for entry (fp32), so drafting after a chunked
    prefill starts from the draft's full context."""
    target, draft = load_model(str(tiny_llama), "float32"), load_model(str(tiny_llama_draft), "float32")
    (prompt,) = random_prompts(43, (77,))
    engines = []
    for budget in (None, 10):
        engine = Engine(
            target,
            ModelDrafter(draft),
            EngineConfig(3, 3, max_model_len=128, adaptive=False, max_prefill_tokens=budget),
        )
        seq = engine.add_request("r", prompt, GREEDY)
        steps = 0
        while not seq.output_ids:
            engine.step()
            steps += 1
        assert steps == (1 if budget is None else math.ceil((len(prompt) - 1) / budget))
        engines.append(engine)
    n = len(prompt) - 1
    whole, chunked = engines
    assert torch.allclose(whole.target.cache.kv[:, 0, :, :n], chunked.target.cache.kv[:, 0, :, :n], atol=1e-5)
    assert chunked.drafter.cached[0] >= n  # type: ignore[union-attr]
    draft_whole, draft_chunked = whole.drafter.runner.cache.kv, chunked.drafter.runner.cache.kv  # type: ignore[union-attr]
    assert torch.allclose(draft_whole[:, 0, :, :n], draft_chunked[:, 0, :, :n], atol=1e-5)


def test_running_streams_decode_while_a_long_prompt_is_prefilled(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    target, draft = load_model(str(tiny_llama), "float32"), load_model(str(tiny_llama_draft), "float32")
    short, long = random_prompts(47, (4, 150))
    budget = 16
    config = EngineConfig(3, 3, max_model_len=256, adaptive=False, max_prefill_tokens=budget)
    engine = Engine(target, ModelDrafter(draft), config)
    _, _, steps, decoded = arrival_beside_a_stream(engine, short, long)
    assert steps == math.ceil((len(long) - 1) / budget)
    assert decoded >= steps  # a token or more every step of the prefill


@needs_kernel
def test_chunks_ride_along_the_verification_on_the_layer_kernels(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    """Where the backend computes every row alone, a prompt's chunks are written in the forward
    that verifies the running sequences: one target forward a step, the prompt's first token
    the step after its last chunk, and every output what plain decoding gives."""
    target, draft = load_model(str(tiny_llama), "bfloat16"), load_model(str(tiny_llama_draft), "bfloat16")
    short, long = random_prompts(59, (4, 70))
    whole = EngineConfig(max_model_len=256, adaptive=False, max_prefill_tokens=None)
    plain = [staggered(Engine(target, None, whole), [p], GREEDY)[0] for p in (short, long)]
    budget = 16
    config = EngineConfig(3, 3, max_model_len=256, adaptive=False, max_prefill_tokens=budget)
    engine = Engine(target, ModelDrafter(draft), config)
    assert engine.target.backend.ragged_rows
    forwards = []
    forward = engine.target.forward

    def counted(*args: object, **kwargs: object) -> object:
        forwards.append(args[2].numel())  # type: ignore[attr-defined]
        return forward(*args, **kwargs)

    engine.target.forward = counted  # type: ignore[method-assign]

    def one_forward() -> None:
        forwards.clear()
        engine.step()
        assert len(forwards) == 1

    running, arrived, steps, _ = arrival_beside_a_stream(engine, short, long, one_forward)
    assert steps == math.ceil((len(long) - 1) / budget) + 1
    while engine.has_unfinished():
        engine.step()
    assert [running.output_ids[:12], arrived.output_ids] == plain
    assert engine.totals.fallback_steps == 0


def test_the_measured_chunk_grows_while_nothing_decodes(
    tiny_llama: Path, tiny_llama_draft: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the chunk measured (``auto``), a prompt that arrives while no sequence decodes is
    prefilled ``IDLE_PREFILL_CHUNKS`` chunks a step (here: whole, in its first step); one that
    arrives beside a decoding sequence a chunk a step; either decodes what plain decoding of a
    whole prefill does; a budget set by hand stays as set."""
    monkeypatch.setattr(engine_module, "measure_prefill_chunk", lambda *args: 16)
    target, draft = load_model(str(tiny_llama), "float32"), load_model(str(tiny_llama_draft), "float32")
    short, first, late = random_prompts(53, (4, 60, 50))
    whole = EngineConfig(max_model_len=256, adaptive=False, max_prefill_tokens=None)
    plain = [staggered(Engine(target, None, whole), [p], GREEDY)[0] for p in (first, late)]
    config = EngineConfig(3, 3, max_model_len=256, adaptive=False)
    engine = Engine(target, ModelDrafter(draft), config)
    assert engine.config.max_prefill_tokens == 16
    assert engine.idle_prefill_tokens == IDLE_PREFILL_CHUNKS * 16 >= len(first)
    alone = engine.add_request("alone", first, GREEDY)
    engine.step()
    assert alone.output_ids  # prefilled whole, then its first step, in one engine step
    while engine.has_unfinished():
        engine.step()
    running, beside, steps, _ = arrival_beside_a_stream(engine, short, late)
    assert running.output_ids and steps == math.ceil((len(late) - 1) / 16)
    while engine.has_unfinished():
        engine.step()
    assert [alone.output_ids, beside.output_ids] == plain
    by_hand = Engine(target, ModelDrafter(draft), replace(config, max_prefill_tokens=16))
    assert by_hand.idle_prefill_tokens == 16


def test_a_failing_draft_prefill_falls_back_and_output_stays(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    target, draft = load_model(str(tiny_llama), "float32"), load_model(str(tiny_llama_draft), "float32")
    prompts = random_prompts(53, (40, 25))
    plain = staggered(Engine(target, None, EngineConfig(max_model_len=128, adaptive=False)), prompts, GREEDY)
    engine = Engine(
        target,
        ModelDrafter(draft),
        EngineConfig(3, 3, max_model_len=128, adaptive=False, max_prefill_tokens=8),
    )
    calls = []

    def broken(slot: int, token_ids: list[int]) -> None:
        calls.append(slot)
        raise RuntimeError("draft prefill failed")

    engine.drafter.prefill = broken  # type: ignore[union-attr]
    assert staggered(engine, prompts, GREEDY) == plain
    assert calls and engine.fallback_reasons["error"] >= len(calls)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_kernel)])
def test_eagle3_chunked_prefill_is_the_targets_output(
    small_vocab_target: Path,  # noqa: F811
    tmp_path: Path,
    dtype: str,
) -> None:
    """The head reads the target's features of every chunk, from a forward of its own or (bf16
    layer kernels: the short prompt decodes meanwhile) from the verification it rides along."""
    head = saved_head(small_vocab_target, tmp_path / "head", seed=12)
    prompts = [
        [5, 6, 7, 4, 5, 6, 4, 4, 5, 7, 6, 5, 4, 7, 7, 6, 5, 6, 7],
        [7],
        [4, 4, 5, 7, 6, 5, 4, 7, 7, 6, 5],
    ]
    outputs = []
    for budget in (None, 4):
        llm = LLM(str(small_vocab_target), str(head), 3, 3, dtype=dtype, drafter="eagle3",
                  adaptive=False, max_prefill_tokens=budget)  # fmt: skip
        assert llm.engine.target.backend.ragged_rows == (dtype == "bfloat16")
        outs = llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
        outputs.append([o.outputs[0].token_ids for o in outs])
        assert llm.engine.totals.accepted_tokens > 0 and llm.engine.totals.fallback_steps == 0
    assert outputs[0] == outputs[1] == plain_outputs(small_vocab_target, prompts, dtype, 20)


@pytest.mark.parametrize("budget", [None, 6])
def test_prompt_logprobs_are_the_models_own(
    tiny_llama: Path, tiny_llama_draft: Path, budget: int | None
) -> None:
    """Every prompt token after the first, against transformers' forward over the prompt, also
    when the prompts were just served (their KV is there to reuse, but it has no logits)."""
    prompts = random_prompts(59, (30, 2, 17))
    llm = LLM(
        str(tiny_llama), str(tiny_llama_draft), dtype="float32", max_model_len=128, max_prefill_tokens=budget
    )
    llm.generate(prompts, GREEDY)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=3))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    for prompt, out in zip(prompts, outs, strict=True):
        records = out.prompt_logprobs
        assert records is not None and len(records) == len(prompt) and records[0] is None
        with torch.no_grad():
            want = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].double(), dim=-1)
        got = [r.logprob for r in records[1:]]  # type: ignore[union-attr]
        assert got == pytest.approx(
            want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist(), abs=1e-4
        )
        for r, row in zip(records[1:], want, strict=True):
            assert r is not None and [t for t, _ in r.top] == torch.topk(row, 3).indices.tolist()
    assert llm.generate(prompts[0], GREEDY)[0].prompt_logprobs is None


def test_a_prompt_that_hits_the_prefix_cache_prefills_only_its_rest_in_chunks(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    target, draft = load_model(str(tiny_llama), "float32"), load_model(str(tiny_llama_draft), "float32")
    shared, first, second, third = random_prompts(61, (60, 9, 21, 30))
    prompts = [shared + first, shared + second, shared + third]
    plain_config = EngineConfig(max_model_len=160, adaptive=False, prefix_caching=False)
    plain = [staggered(Engine(target, None, plain_config), [p], GREEDY)[0] for p in prompts]
    budget = 8
    config = EngineConfig(3, 3, max_model_len=160, adaptive=False, max_prefill_tokens=budget)
    engine = Engine(target, ModelDrafter(draft), config)
    outputs = [staggered(engine, prompts[:1], GREEDY)[0]]  # finished: its slot keeps its prefix
    running = engine.add_request("running", prompts[1], GREEDY)  # reuses the finished one's prefix
    while not running.output_ids:
        engine.step()
    late = engine.add_request("late", prompts[2], GREEDY)  # shares the running one's prefix
    before, steps = len(running.output_ids), 0
    while not late.output_ids:
        engine.step()
        steps += 1
    assert running.cached_tokens >= len(shared) and late.cached_tokens >= len(shared)
    assert steps == math.ceil((len(prompts[2]) - 1 - late.cached_tokens) / budget) > 1
    assert len(running.output_ids) - before >= steps
    while engine.has_unfinished():
        engine.step()
    outputs += [running.output_ids, late.output_ids]
    assert outputs == plain
