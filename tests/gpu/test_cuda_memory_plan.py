"""The memory plan on a real GPU: measured numbers, caches sized from them, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multiguess import LLM, SamplingParams
from multiguess.errors import EngineConfigError, InsufficientMemoryError


def test_the_plan_sizes_the_caches_and_stays_inside_the_budget(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    torch.cuda.reset_peak_memory_stats()
    llm = LLM(
        str(tiny_llama), str(tiny_llama_draft), dtype="float32", device="cuda", max_batch=4, adaptive=False
    )
    engine, plan = llm.engine, llm.engine.memory_plan
    assert plan is not None
    assert engine.config.max_model_len == 512  # the tiny config's limit: the default where planned
    assert plan.sequences == 4 and engine.target.cache.num_slots == 4
    # The paged cache's pool is the plan's blocks: the planned sequences' capacity, whole blocks.
    assert engine.target.cache.kv.shape[1] == plan.blocks(plan.models[0])[0]
    # fp32 caches: 2 layers x (keys + values) x 2 kv heads x 16 dims x 4 bytes per token.
    assert [m.kv_bytes_per_token for m in plan.models] == [512, 512]
    assert all(m.weights > 0 and m.activation_peak > 0 for m in plan.models)
    device = plan.devices[0]
    assert device.fits >= 4 and device.elsewhere > 0  # the CUDA context at least
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True))
    total = torch.cuda.mem_get_info(engine.target.device)[1]
    assert torch.cuda.max_memory_reserved(engine.target.device) + device.elsewhere <= total * plan.utilization


def test_a_utilization_that_cannot_fit_fails_before_any_request(tiny_llama: Path) -> None:
    with pytest.raises(InsufficientMemoryError, match="gpu_memory_utilization 1e-05"):
        LLM(str(tiny_llama), None, dtype="float32", device="cuda", gpu_memory_utilization=1e-5)


def test_max_model_len_above_the_config_fails_on_cuda(tiny_llama: Path) -> None:
    with pytest.raises(EngineConfigError, match="exceeds the model's own limit of 512"):
        LLM(str(tiny_llama), None, dtype="float32", device="cuda", max_model_len=1024)
