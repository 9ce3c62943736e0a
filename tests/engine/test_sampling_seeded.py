"""A seeded sample is a function of its seed: speculation (any tree, chain, batch, adaptive
or not) reproduces plain seeded decoding token for token. Its exactness in distribution is
tested with the other samplers in test_sampling_exact.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multiguess import LLM, SamplingParams
from multiguess.engine.acceptance import SeededChoices
from multiguess.engine.backends.cpu import bf16_kernel
from multiguess.engine.sampling import (
    NodeDistributions,
    Processing,
    position_key,
    position_noise,
    race_top,
    scored_choice,
    seeded_choice,
    sorted_processed_probs,
)
from multiguess.engine.tree import TokenTree
from scipy.stats import chisquare, kstest

from tests.engine.test_lossless import random_prompts

SEEDED = dict(max_tokens=24, ignore_eos=True, temperature=0.9, top_p=0.95, seed=7, n=2)
PENALIZED = dict(SEEDED, presence_penalty=0.5, repetition_penalty=1.2, top_k=20)


def token_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.token_ids for out in llm.generate(prompts, params) for o in out.outputs]


@pytest.mark.parametrize("settings", [SEEDED, PENALIZED], ids=["seeded", "penalized"])
@pytest.mark.parametrize(("num_candidates", "depth"), [(1, 4), (3, 4), (4, 2)])
def test_seeded_speculation_equals_plain_seeded_decoding(
    tiny_llama: Path, tiny_llama_draft: Path, settings: dict, num_candidates: int, depth: int
) -> None:
    prompts = random_prompts(21, (3, 12, 40))
    params = SamplingParams(**settings)  # type: ignore[arg-type]
    spec = LLM(str(tiny_llama), str(tiny_llama_draft), num_candidates, depth, dtype="float32", adaptive=False)
    expected = token_ids(LLM(str(tiny_llama), None, dtype="float32"), prompts, params)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for out in outs for o in out.outputs] == expected
    assert sum(o.stats["accepted_tokens"] for out in outs for o in out.outputs) > 0
    assert len({tuple(ids) for ids in expected}) == len(expected), "samples of one prompt must differ"


def test_seeded_output_does_not_depend_on_the_policy_or_the_batch(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    prompts = random_prompts(22, (5, 17, 33, 8))
    params = SamplingParams(**SEEDED)  # type: ignore[arg-type]
    expected = token_ids(LLM(str(tiny_llama), None, dtype="float32"), prompts, params)
    adaptive = LLM(str(tiny_llama), str(tiny_llama_draft), 3, 4, dtype="float32", adaptive=True, max_batch=3)
    assert token_ids(adaptive, prompts, params) == expected
    one_by_one = [ids for prompt in prompts for ids in token_ids(adaptive, [prompt], params)]
    assert one_by_one == expected


@pytest.mark.parametrize(
    "processing", [Processing(1.0), Processing(0.8, top_p=0.9), Processing(1.3, top_k=3)]
)
@pytest.mark.parametrize("size", [6, 4096])  # at 4096 truncated rows race over their kept tokens
def test_a_node_draws_with_the_noise_of_its_position(processing: Processing, size: int) -> None:
    vocab = torch.arange(size)
    logits = torch.randn(3, size, generator=torch.Generator().manual_seed(0)) * (3 if size > 6 else 1)
    probs = sorted_processed_probs(logits, [processing] * 3)
    tree = TokenTree((0, 1, 4), (-1, 0, 0))  # two children of the root: both choose position 11
    noise = position_noise(3, [10, 11], vocab)
    expected = (probs / noise[[0, 1, 1]]).argmax(-1).tolist()
    choices = SeededChoices(NodeDistributions(logits, processing), tree, seed=3, length=10)
    assert [choices[i] for i in range(3)] == expected
    assert torch.equal(position_noise(3, [11], vocab[2:4]), noise[1:, 2:4])  # per token, not per row
    assert not torch.equal(position_noise(4, [11], vocab), noise[1:])


def test_the_race_over_the_support_is_the_race_over_the_vocabulary() -> None:
    """``race_top`` makes noise only for the tokens some row can draw: the winners (and their
    order) are those of racing every token under its noise, for truncated and whole rows."""
    gen = torch.Generator().manual_seed(1)
    vocab = torch.arange(100, 400)  # column j is token 100 + j
    probs = torch.softmax(torch.randn(3, 300, generator=gen, dtype=torch.float64) * 3, -1)
    probs[0, probs[0] < probs[0].topk(5).values[-1]] = 0.0  # a truncated row beside whole ones
    probs[2, probs[2] < probs[2].topk(40).values[-1]] = 0.0
    for rows in ([0, 2], [0, 1, 2]):
        positions = [7, 9, 7][: len(rows)]
        noise = position_noise(5, [7, 9], vocab)[[0 if p == 7 else 1 for p in positions]]
        expected = torch.topk(probs[rows] / noise, 4, dim=-1).indices
        assert torch.equal(race_top(probs[rows], 5, positions, vocab, 4), expected)
        # Row 0 can draw 5 tokens only: its 5 winners, then columns it cannot draw.
        winners = race_top(probs[rows], 5, positions, vocab, 8)
        expected = torch.topk(probs[rows] / noise, 8, dim=-1).indices
        assert torch.equal(winners[0, :5], expected[0, :5]) and not probs[0, winners[0, 5:]].any()
        assert torch.equal(winners[1:], expected[1:])


def test_the_noise_is_exponential() -> None:
    """Its CDF is 1 - exp(-e): uniform after the transform (Kolmogorov-Smirnov)."""
    noise = position_noise(9, list(range(40)), torch.arange(500)).flatten()
    assert kstest(1 - torch.exp(-noise).numpy(), "uniform").pvalue > 1e-3


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_the_race_from_logits_is_the_race_over_probabilities(temperature: float) -> None:
    """An untruncated row's seeded choice, straight from its logits, is the winner of
    ``race_top`` over its softmax, and (on CPUs with the kernel, which scores only the tokens
    that can still win) of scoring every token, at the vocabulary size of a real model."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(49152, generator=gen) * 4
    logits[torch.randperm(49152, generator=gen)[:500]] = float("-inf")  # masked tokens
    probs = torch.softmax(logits.double() / temperature, -1)
    kernel = bf16_kernel.library() is not None
    for position in range(120):
        expected = scored_choice(logits, temperature, position_key(11, position))
        assert seeded_choice(logits, temperature, 11, position) == expected
        if position < 20:
            assert int(race_top(probs[None], 11, [position], torch.arange(49152), 1)[0, 0]) == expected
        if kernel:
            assert bf16_kernel.seeded_argmax(logits, temperature, position_key(11, position)) == expected


def test_the_race_from_logits_samples_the_softmax() -> None:
    """Over many positions, the seeded choices of one row follow softmax(logits / T)
    (chi-square over the likeliest tokens and the rest together)."""
    logits = torch.randn(3000, generator=torch.Generator().manual_seed(3)) * 3
    probs = torch.softmax(logits.double() / 0.7, -1)
    top = torch.topk(probs, 12).indices
    bucket = torch.full((3000,), 12, dtype=torch.long)
    bucket[top] = torch.arange(12)
    draws = 6000
    counts = torch.bincount(
        torch.tensor([bucket[seeded_choice(logits, 0.7, 5, t)] for t in range(draws)]), minlength=13
    )
    expected = torch.zeros(13, dtype=torch.float64).index_add_(0, bucket, probs) * draws
    assert chisquare(counts.double().numpy(), expected.numpy()).pvalue > 1e-3
