"""Sampled speculation on CUDA keeps the target's distribution exactly (chi-square against
enumeration, as tests/engine/test_sampling_exact.py does on the CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
from multiguess import LLM, SamplingParams

from tests.engine.test_sampling_exact import (
    ALPHA,
    LENGTH,
    SAMPLES,
    chi_square_pvalue,
    draw,
    exact_distribution,
    small_vocab_pair,  # noqa: F401 (a fixture)
)

SETTINGS = {
    "t1": dict(temperature=1.0),
    "t0.6-topk5": dict(temperature=0.6, top_k=5),
    "t1.3-topp0.8": dict(temperature=1.3, top_p=0.8),
}


@pytest.mark.parametrize(
    ("num_candidates", "depth", "setting"),
    [(3, 2, "t1"), (1, 2, "t1"), (3, 2, "t0.6-topk5"), (4, 2, "t1.3-topp0.8")],
)
def test_speculative_sampling_on_cuda_matches_the_target(
    small_vocab_pair: tuple[Path, Path],  # noqa: F811 (the imported fixture)
    num_candidates: int,
    depth: int,
    setting: str,
) -> None:
    target, draft = small_vocab_pair
    llm = LLM(str(target), str(draft), num_candidates, depth, dtype="float32", device="cuda", max_batch=256)
    params = SamplingParams(max_tokens=LENGTH, ignore_eos=True, n=SAMPLES, seed=17, **SETTINGS[setting])
    samples = draw(llm, params)
    assert len(samples) == SAMPLES
    pvalue = chi_square_pvalue(samples, exact_distribution(target, params))
    assert pvalue > ALPHA, f"k={num_candidates} depth={depth} {setting}: p = {pvalue:.2e}"


def test_the_cuda_test_rejects_the_draft_distribution(small_vocab_pair: tuple[Path, Path]) -> None:  # noqa: F811
    target, draft = small_vocab_pair
    params = SamplingParams(max_tokens=LENGTH, ignore_eos=True, n=SAMPLES, seed=17, temperature=1.0)
    samples = draw(LLM(str(draft), None, dtype="float32", device="cuda", max_batch=256), params)
    assert chi_square_pvalue(samples, exact_distribution(target, params)) < ALPHA


def test_a_seeded_sample_on_cuda_repeats(small_vocab_pair: tuple[Path, Path]) -> None:  # noqa: F811
    target, draft = small_vocab_pair
    llm = LLM(str(target), str(draft), dtype="float32", device="cuda")
    params = SamplingParams(max_tokens=12, ignore_eos=True, seed=3, temperature=1.0)
    first = llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    assert llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids == first
