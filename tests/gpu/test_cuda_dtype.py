"""``--dtype auto`` on CUDA: bf16 only where the model's own device runs it natively (compute
capability 8.0 or newer), else fp16."""

from __future__ import annotations

from pathlib import Path

import torch
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
