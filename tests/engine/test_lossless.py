"""Speculative greedy output equals plain greedy output of transformers, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multiguess import LLM, SamplingParams
from transformers import AutoModelForCausalLM

MAX_TOKENS = 24


def random_prompts(seed: int, lengths: tuple[int, ...], vocab: int = 64) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=generator).tolist() for n in lengths]


def reference(
    model_dir: Path, prompts: list[list[int]], max_tokens: int, ignore_eos: bool
) -> list[list[int]]:
    """transformers' own greedy decoding, one prompt at a time (no padding effects)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eos = model.generation_config.eos_token_id
    if ignore_eos:
        model.generation_config.eos_token_id = None
    outs = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
        new = ids[0, len(prompt) :].tolist()
        if not ignore_eos and eos in new:
            new = new[: new.index(eos) + 1]
        outs.append(new)
    return outs


@pytest.fixture(scope="module")
def references(tiny_llama: Path, tiny_qwen2: Path) -> dict:
    cache: dict = {}

    def get(model_dir: Path, seed: int, lengths: tuple[int, ...]) -> tuple[list[list[int]], list[list[int]]]:
        key = (model_dir, seed, lengths)
        if key not in cache:
            prompts = random_prompts(seed, lengths)
            cache[key] = (prompts, reference(model_dir, prompts, MAX_TOKENS, ignore_eos=True))
        return cache[key]

    return get  # type: ignore[return-value]


CONFIGS = [(1, 1), (1, 4), (2, 3), (3, 4), (4, 6), (5, 8), (3, 2)]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize(("num_candidates", "depth"), CONFIGS)
def test_tree_speculation_is_lossless(
    request: pytest.FixtureRequest, references: dict, family: str, num_candidates: int, depth: int
) -> None:
    target = request.getfixturevalue(f"tiny_{family}")
    draft = request.getfixturevalue(f"tiny_{family}_draft")
    llm = LLM(str(target), str(draft), num_candidates, depth, dtype="float32", max_batch=4, adaptive=False)
    for seed, lengths in [(num_candidates * 10 + depth, (1, 2, 9, 33)), (depth, (64, 117))]:
        prompts, expected = references(target, seed, lengths)
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        assert [o.token_ids for o in outs] == expected
        assert sum(o.stats["draft_tokens"] for o in outs) > 0


@pytest.mark.parametrize(("num_candidates", "depth"), [(1, 3), (3, 4), (2, 7)])
def test_draft_equal_to_target_accepts_every_level(tiny_llama: Path, num_candidates: int, depth: int) -> None:
    """With the target as its own draft every drafted level is accepted: depth + 1 per step."""
    llm = LLM(str(tiny_llama), str(tiny_llama), num_candidates, depth, dtype="float32", adaptive=False)
    max_tokens = 4 * (depth + 1)
    outs = llm.generate(random_prompts(7, (3, 20)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    for out in outs:
        assert out.stats["mean_accepted_length"] == depth + 1
        assert out.stats["verify_steps"] == 4


def test_plain_decoding_matches_transformers_including_eos(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), None, dtype="float32")
    prompts = random_prompts(11, (1, 4, 15, 40, 80))
    expected = reference(tiny_llama, prompts, 40, ignore_eos=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=40))
    assert [o.token_ids for o in outs] == expected
    assert all(o.stats["draft_tokens"] == 0 for o in outs)


def test_speculation_stops_at_eos_like_plain(tiny_llama: Path, tiny_llama_draft: Path) -> None:
    llm = LLM(str(tiny_llama), str(tiny_llama_draft), dtype="float32")
    prompts = random_prompts(11, (1, 4, 15, 40, 80))
    outs = llm.generate(prompts, SamplingParams(max_tokens=40))
    assert [o.token_ids for o in outs] == reference(tiny_llama, prompts, 40, ignore_eos=False)


def test_batched_equals_one_by_one(tiny_llama: Path, tiny_llama_draft: Path) -> None:
    llm = LLM(str(tiny_llama), str(tiny_llama_draft), dtype="float32", max_batch=3)
    prompts = random_prompts(5, (1, 3, 8, 13, 21, 34, 55))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone


def test_int8_draft_is_lossless(tiny_llama: Path, tiny_llama_draft: Path) -> None:
    llm = LLM(str(tiny_llama), str(tiny_llama_draft), dtype="float32", draft_quantization="int8")
    prompts = random_prompts(3, (2, 30))
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference(tiny_llama, prompts, MAX_TOKENS, ignore_eos=True)


def test_sequences_leaving_in_any_order_keep_slots_contiguous_and_outputs_exact(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    """Early finishers free low slots; the sequence in the highest slot moves down with its target
    and draft caches: outputs and what the draft proposed and got accepted match serving alone."""
    # No copy drafts: the second run would copy the first one's outputs (tests/engine/test_suffix.py).
    llm = LLM(
        str(tiny_llama),
        str(tiny_llama_draft),
        2,
        3,
        dtype="float32",
        max_batch=4,
        adaptive=False,
        prompt_lookup=0,
    )
    engine = llm.engine
    prompts = random_prompts(9, (5, 17, 3, 30, 11, 8))
    lengths = (4, 30, 9, 22, 6, 15)
    alone = [
        llm.generate([p], SamplingParams(max_tokens=n, ignore_eos=True))[0]
        for p, n in zip(prompts, lengths, strict=True)
    ]
    seqs = [
        engine.add_request(str(i), p, SamplingParams(max_tokens=n, ignore_eos=True))
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    moved = set()
    while engine.has_unfinished():
        before = {s.request_id: s.slot for s in engine.running}
        engine.step()
        moved |= {s.request_id for s in engine.running if before.get(s.request_id, s.slot) != s.slot}
        assert [s.slot for s in engine.running] == list(range(len(engine.running)))
    assert moved, "no sequence changed slot: the test does not exercise moves"
    assert [s.output_ids for s in seqs] == [o.token_ids for o in alone]
    assert [s.stats.as_dict() for s in seqs] == [o.stats for o in alone]
