"""Greedy speculation on CUDA is token-identical to plain decoding on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multiguess import LLM, SamplingParams

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20] * 12, [7, 8, 9, 7, 8, 9, 7, 8]]


@pytest.fixture(scope="module", autouse=True)
def exact_float32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def outputs(llm: LLM, batched: bool) -> list[list[int]]:
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    if batched:
        return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]
    return [llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize(
    ("num_candidates", "depth", "drafter"), [(3, 4, "model"), (1, 4, "model"), (3, 4, "ngram")]
)
@pytest.mark.parametrize("batched", [False, True])
def test_greedy_speculation_equals_plain_decoding_on_cuda(
    tiny_llama: Path, tiny_llama_draft: Path, num_candidates: int, depth: int, drafter: str, batched: bool
) -> None:
    plain = LLM(str(tiny_llama), None, dtype="float32", device="cuda", drafter="none", adaptive=False)
    draft = str(tiny_llama_draft) if drafter == "model" else None
    spec = LLM(
        str(tiny_llama),
        draft,
        num_candidates,
        depth,
        dtype="float32",
        device="cuda",
        drafter=drafter,
        adaptive=False,
    )
    assert spec.engine.target.device.type == "cuda"
    assert outputs(spec, batched) == outputs(plain, batched=False)


def test_adaptive_greedy_on_cuda_equals_plain(tiny_llama: Path, tiny_llama_draft: Path) -> None:
    """The adaptive policy's probes (observations included) run on the device too."""
    plain = LLM(str(tiny_llama), None, dtype="float32", device="cuda", drafter="none")
    spec = LLM(str(tiny_llama), str(tiny_llama_draft), dtype="float32", device="cuda")
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    got = [r.outputs[0].token_ids for r in spec.generate(PROMPTS, params)]
    assert got == [r.outputs[0].token_ids for r in plain.generate(PROMPTS, params)]
