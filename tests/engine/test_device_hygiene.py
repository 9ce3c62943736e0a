"""Every tensor meets tensors of its own device: host/device mixing, found on the CPU.

CUDA refuses an op that mixes a host tensor with a device tensor, and a host generator
sampling a device tensor; the CPU allows both, so such bugs hide on development machines.
``tests/fake_device.py`` makes the engine's own tensors a simulated device while everything
created without a device stays "host", and records every mismatch, including those the engine
catches and swallows (a failing draft falls back to plain decoding). Each path below must run
with no mismatch; greedy paths must also give the same tokens as without the simulation.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multiguess import LLM, SamplingParams
from multiguess.engine.config import EngineConfig
from multiguess.engine.drafters.model import ModelDrafter
from multiguess.engine.engine import Engine
from multiguess.engine.tree import TokenTree
from multiguess.models.loading import load_model

from tests.engine.test_lossless import random_prompts
from tests.fake_device import META, FakeDevice

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SAMPLED = [
    SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=3),
    SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, top_k=20, top_p=0.9, seed=4),
    SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.7, top_p=0.8),
]


def on_device(engine_owner: object, run: object) -> tuple[object, list[str]]:
    """``run()`` with ``engine_owner``'s tensors on the simulated device; its result and the
    mismatches seen."""
    mode = FakeDevice()
    with mode:
        mode.adopt(engine_owner)
        result = run()  # type: ignore[operator]
    return result, mode.caught


def token_ids(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def decode(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    seqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize(("num_candidates", "depth"), [(3, 3), (1, 4)], ids=["tree", "chain"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_and_sampled_speculation_stay_on_the_device(
    tiny_llama: Path, tiny_llama_draft: Path, num_candidates: int, depth: int, backend: str
) -> None:
    prompts = random_prompts(21, (5, 17, 9))
    config = EngineConfig(
        num_candidates, depth, max_batch=4, max_model_len=128, adaptive=False, backend=backend
    )
    target, draft = load_model(str(tiny_llama), "float32"), load_model(str(tiny_llama_draft), "float32")
    expected = decode(Engine(target, ModelDrafter(draft), config), prompts, GREEDY)
    engine = Engine(target, ModelDrafter(draft), config)
    got, caught = on_device(engine, lambda: decode(engine, prompts, GREEDY))
    assert caught == []
    assert got == expected
    assert engine.totals.accepted_tokens > 0  # speculation ran, not a fallback
    for params in SAMPLED:
        outs, caught = on_device(engine, lambda p=params: decode(engine, prompts, p))
        assert caught == [], params
        assert all(len(o) == params.max_tokens for o in outs)
    assert engine.totals.fallback_steps == 0


def test_ngram_drafting_stays_on_the_device(tiny_llama: Path) -> None:
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], *random_prompts(22, (12,))]
    llm = LLM(str(tiny_llama), None, 2, 3, dtype="float32", drafter="ngram", adaptive=False)
    expected = token_ids(llm.generate(prompts, GREEDY))
    got, caught = on_device(llm, lambda: token_ids(llm.generate(prompts, GREEDY)))
    assert caught == []
    assert got == expected
    for params in SAMPLED:
        _, caught = on_device(llm, lambda p=params: llm.generate(prompts, p))
        assert caught == []


def test_observation_probes_stay_on_the_device(tiny_llama: Path, tiny_llama_draft: Path) -> None:
    """A greedy sequence probes by observation while drafting is off (Planner._observe)."""
    llm = LLM(str(tiny_llama), str(tiny_llama_draft), 3, 3, dtype="float32", adaptive=False)
    drafter, tokens = llm.engine.drafter, random_prompts(23, (20,))[0]
    expected = drafter.observe(0, tokens, 3, 10)
    drafter.release(0)
    got, caught = on_device(llm, lambda: drafter.observe(0, tokens, 3, 10))
    assert caught == []
    assert got == expected and len(got) == 10


def test_distill_teacher_stays_on_the_device(tmp_path: Path) -> None:
    from multiguess.distill.dataset import DataPlan, load_teacher, teacher_runner
    from multiguess.distill.teacher import reply_records, teacher_forced_records

    from tests.test_distill import tiny_target

    folder = tiny_target(tmp_path / "target")
    model, tokenizer = load_teacher(folder, "float32")
    runner = teacher_runner(model, tokenizer, folder, DataPlan(batch=2, max_new_tokens=4, k=3))
    records, caught = on_device(runner, lambda: reply_records(runner, tokenizer, ["Hi", "Why?"], 4, 3))
    assert caught == []
    assert all(r.topk_ids.device.type == "cpu" for r in records)  # shards are written from the host
    pairs = [("Hi", "Hello there"), ("Why?", "Because")]
    records, caught = on_device(model, lambda: teacher_forced_records(model, tokenizer, pairs, 3))
    assert caught == [] and len(records) == 2


def test_the_simulation_catches_a_host_tensor_meeting_a_device_tensor(tiny_llama: Path) -> None:
    """The check itself can fail: a host tensor added to the runner's logits is caught."""
    llm = LLM(str(tiny_llama), None, dtype="float32")
    runner = llm.engine.target

    def mixed() -> None:
        logits = runner.forward_trees([0], [0], [TokenTree.chain([4, 5])])
        assert logits.device == META
        logits + torch.ones(logits.shape[-1])

    with pytest.raises(RuntimeError, match="host tensor meets a device tensor"):
        on_device(llm, mixed)
