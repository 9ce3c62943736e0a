"""CUDA graphs replay the same forwards as eager: the same tokens, greedy and seeded sampling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multiguess import LLM, SamplingParams

from tests.gpu.test_cuda_lossless import PROMPTS


@pytest.mark.parametrize("drafter", ["none", "model"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graphs_decode_what_eager_decodes(
    tiny_llama: Path, tiny_llama_draft: Path, drafter: str, temperature: float
) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    draft = str(tiny_llama_draft) if drafter == "model" else None
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=temperature, seed=5)
    runs = []
    for graphs in (False, True):
        llm = LLM(
            str(tiny_llama),
            draft,
            dtype="float32",
            device="cuda",
            drafter=drafter,
            adaptive=False,
            cuda_graphs=graphs,
        )
        runs.append([r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)])
    assert runs[1] == runs[0]
