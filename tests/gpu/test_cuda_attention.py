"""No CUDA attention call reaches SDPA's math kernel (which repeats keys and values to every
query head and upcasts): each path of the torch backend's attention, and whole speculative
decodes with and without CUDA graphs, run under ``sdpa_kernel`` with MATH excluded, where a
call that would fall back to it raises. ``make gpu-check`` runs the same attention cases."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from multiguess import LLM, SamplingParams

from tests.gpu.test_cuda_lossless import PROMPTS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import gpu_check


def test_every_attention_path_is_fused_and_matches_float64() -> None:
    section = gpu_check.Section("fused attention")
    gpu_check.fused_attention(gpu_check.profile("cuda", None), section, gpu_check.Budget(600))
    assert section.rows and all(row["status"] == "pass" for row in section.rows), section.rows


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_decoding_never_reaches_the_math_kernel(
    tiny_llama: Path, tiny_llama_draft: Path, dtype: str, graphs: bool
) -> None:
    llm = LLM(
        str(tiny_llama),
        str(tiny_llama_draft),
        dtype=dtype,
        device="cuda",
        adaptive=False,
        cuda_graphs=graphs,
    )
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with gpu_check.no_math_attention(torch.device("cuda")):
        outputs = llm.generate(PROMPTS, params)
    assert [len(r.outputs[0].token_ids) for r in outputs] == [24] * len(PROMPTS)
