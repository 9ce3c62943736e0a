"""``--dtype auto`` on CUDA: bf16 only where the model's own device runs it natively (compute
capability 8.0 or newer), else fp16."""

from __future__ import annotations

from pathlib import Path

import torch
from multiguess import LLM, SamplingParams
from multiguess.models.loading import load_model, resolve_dtype


def native(index: int) -> torch.dtype:
    return torch.bfloat16 if torch.cuda.get_device_capability(index) >= (8, 0) else torch.float16


def test_auto_follows_each_devices_compute_capability() -> None:
    for index in range(torch.cuda.device_count()):
        assert resolve_dtype("auto", f"cuda:{index}") == native(index)


def test_a_model_loaded_with_auto_runs_in_that_dtype(tiny_llama: Path) -> None:
    loaded = load_model(str(tiny_llama), dtype="auto", device="cuda:0")
    assert loaded.dtype == native(0)
    assert next(loaded.model.parameters()).dtype == native(0)
    assert next(loaded.model.parameters()).device.type == "cuda"


def test_the_draft_has_its_own_dtype(tiny_llama: Path, tiny_llama_draft: Path) -> None:
    """A float16 draft beside a float32 target: each runs in its own dtype, and the output is
    still the target's own (float32, where verification shapes do not change the argmax)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    llm = LLM(str(tiny_llama), str(tiny_llama_draft), dtype="float32", draft_dtype="float16", device="cuda")
    assert llm.engine.target.dtype == torch.float32
    assert llm.engine.drafter.runner.dtype == torch.float16
    plain = LLM(str(tiny_llama), None, dtype="float32", device="cuda", drafter="none")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompt = [[5, 6, 7, 8]]
    assert (
        llm.generate(prompt, params)[0].outputs[0].token_ids
        == plain.generate(prompt, params)[0].outputs[0].token_ids
    )
