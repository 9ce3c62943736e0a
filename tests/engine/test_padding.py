"""Prefills split so that no forward pads past the budget the memory plan measured."""

from __future__ import annotations

from pathlib import Path

from multiguess import SamplingParams
from multiguess.engine.config import EngineConfig
from multiguess.engine.drafters.model import ModelDrafter
from multiguess.engine.engine import Engine
from multiguess.engine.padding import padded_groups, prefill_chunks
from multiguess.models.loading import load_model

from tests.engine.test_device_hygiene import decode
from tests.engine.test_lossless import random_prompts


def test_runs_keep_order_and_stay_within_the_padded_budget() -> None:
    lengths = [10, 30, 5, 100, 3, 3, 3]
    groups = padded_groups(lengths, 64)
    assert [i for g in groups for i in g] == list(range(len(lengths)))
    assert groups == [[0, 1], [2], [3], [4, 5, 6]]
    for group in groups:
        if len(group) > 1:
            assert max(lengths[i] for i in group) * len(group) <= 64


def test_runs_pad_no_chain_past_its_room() -> None:
    """A short chain near the end of its cache slot runs apart from longer ones, whose padding
    it would otherwise write past the slot."""
    assert padded_groups([2, 48, 40], 1000, rooms=[10, 60, 50]) == [[0], [1, 2]]
    assert padded_groups([2, 8], 1000, rooms=[10, 60]) == [[0, 1]]
    assert padded_groups([48, 2], 1000, rooms=[60, 10]) == [[0], [1]]


def test_prefill_chunks_serve_the_earliest_first_within_the_budget() -> None:
    assert prefill_chunks([100, 30, 5], 64) == [64, 0, 0]
    assert prefill_chunks([10, 30, 5], 32) == [10, 22, 0]
    assert prefill_chunks([10, 3], 64) == [10, 3]
    assert prefill_chunks([100, 30], None) == [100, 30]  # no budget: every prompt whole
    assert prefill_chunks([], 8) == []


def test_everything_fits_in_one_forward_when_the_budget_allows() -> None:
    assert padded_groups([4, 8, 2], 24) == [[0, 1, 2]]
    assert padded_groups([], 8) == []


def test_chunked_prefills_near_the_context_limit_stay_in_their_slots(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    """Prompts close to max_model_len prefilled in chunks: one prompt's short last chunk and
    another's full one share a step, and the forward does not pad the short one past its slot;
    the output is what each prompt decodes alone."""
    target, draft = load_model(str(tiny_llama), "float32"), load_model(str(tiny_llama_draft), "float32")
    prompts = random_prompts(42, (153, 150, 151, 152))
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    config = EngineConfig(3, 4, max_batch=4, max_model_len=160, adaptive=False, max_prefill_tokens=50)
    alone = [decode(Engine(target, None, config), [p], params)[0] for p in prompts]
    assert decode(Engine(target, ModelDrafter(draft), config), prompts, params) == alone


def test_split_prefills_decode_what_each_prompt_decodes_alone(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    """Prompts whose padded prefill exceeds max_model_len are prefilled (target) and caught up
    (draft) in several forwards; the output is what each decodes alone, token for token."""
    target, draft = load_model(str(tiny_llama), "float32"), load_model(str(tiny_llama_draft), "float32")
    prompts = random_prompts(41, (90, 80, 70, 5))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    config = EngineConfig(3, 3, max_batch=4, max_model_len=128, adaptive=False)
    alone = [decode(Engine(target, None, config), [p], params)[0] for p in prompts]
    assert padded_groups([len(p) - 1 for p in prompts], config.max_model_len) != [[0, 1, 2, 3]]
    assert decode(Engine(target, ModelDrafter(draft), config), prompts, params) == alone
