"""The fast processing (a top-k prefix) equals the reference (a whole-row sort), and the
inverse-CDF draws sample what they should."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from multiguess.engine import sampling
from multiguess.engine.backends.cpu import bf16_kernel
from multiguess.engine.sampling import (
    Processing,
    draw,
    draw_without_replacement,
    kept_tokens,
    processed_probs,
    sorted_processed_probs,
)
from scipy.stats import chisquare

VOCAB = 4096
ROWS = [
    Processing(0.7, 0.9),
    Processing(1.0, 0.95),
    Processing(0.7, 1.0, 50),
    Processing(1.3, 0.8, 40),
    Processing(1.0, 0.5, 300),  # top-k wider than the prefix
    Processing(1.0),  # nothing to truncate, in a batch that truncates
    Processing(0.5, 0.99, 1),
]


def peaked_logits(rows: int, seed: int, scale: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=generator) * scale


@pytest.mark.parametrize("scale", [8.0, 3.0, 0.1])  # peaked (prefix settles), flat (falls back)
def test_fast_processing_equals_the_sorted_reference(scale: float, monkeypatch: pytest.MonkeyPatch) -> None:
    sorted_rows = []
    reference_sort = sampling._sorted

    def counting(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        sorted_rows.append(len(scores))
        return reference_sort(scores, top_k, top_p)

    logits = peaked_logits(len(ROWS) * 3, seed=int(scale * 10), scale=scale)
    rows = ROWS * 3
    expected = sorted_processed_probs(logits, rows)
    monkeypatch.setattr(sampling, "_sorted", counting)
    fast = processed_probs(logits, rows)
    assert torch.equal(fast > 0, expected > 0), "the kept sets differ"
    torch.testing.assert_close(fast, expected, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(fast.sum(-1), torch.ones(len(rows), dtype=torch.float64))
    if scale == 8.0:
        assert not sorted_rows, "peaked rows are settled by the prefix alone"
    if scale == 0.1:
        assert sum(sorted_rows) > 0, "flat top-p rows need the whole sort"


def test_untruncated_rows_are_a_plain_softmax() -> None:
    logits = peaked_logits(3, seed=1, scale=2.0)
    probs = processed_probs(logits, [Processing(0.8)] * 3)
    torch.testing.assert_close(probs, torch.softmax(logits.double() / 0.8, dim=-1))


def test_draw_samples_the_distribution() -> None:
    probs = torch.tensor([0.0, 0.1, 0.0, 0.4, 0.2, 0.3], dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    counts = Counter(draw(probs, generator) for _ in range(4000))
    assert set(counts) <= {1, 3, 4, 5}
    observed = [counts[i] for i in (1, 3, 4, 5)]
    assert chisquare(observed, [400, 1600, 800, 1200]).pvalue > 1e-3


def test_draw_without_replacement_matches_sequential_draws() -> None:
    """P(first = a, second = b) = p(a) * p(b) / (1 - p(a)): what torch.multinomial draws."""
    probs = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    generator = torch.Generator().manual_seed(1)
    counts = Counter(tuple(draw_without_replacement(probs, 2, generator)) for _ in range(6000))
    pairs = [(a, b) for a in range(3) for b in range(3) if a != b]
    expected = [6000 * probs[a].item() * probs[b].item() / (1 - probs[a].item()) for a, b in pairs]
    assert chisquare([counts[p] for p in pairs], expected).pvalue > 1e-3
    assert draw_without_replacement(torch.tensor([0.0, 1.0, 0.0]), 3, generator) == [1]


@pytest.mark.parametrize("scale", [8.0, 0.1])  # peaked (a prefix settles), flat (the sort)
def test_node_distributions_process_the_rows_read_and_only_those(
    scale: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sampled tree's rows are processed as acceptance reads them, once each, and equal the
    rows of processing the whole tree at once, whether a prefix settles them or not."""
    logits = peaked_logits(6, 4, scale)
    setting = Processing(0.7, 0.9)
    whole = processed_probs(logits, [setting] * 6)
    processed, kept = [], []

    def counted(x: torch.Tensor, rows: list[Processing]) -> torch.Tensor:
        processed.append(len(x))
        return processed_probs(x, rows)

    def counted_kept(x: torch.Tensor, row: Processing) -> tuple[torch.Tensor, torch.Tensor] | None:
        kept.append(x)
        return kept_tokens(x, row)

    monkeypatch.setattr(sampling, "processed_probs", counted)
    monkeypatch.setattr(sampling, "kept_tokens", counted_kept)
    nodes = sampling.NodeDistributions(logits, setting)
    for node in (0, 3, 3, 5):
        torch.testing.assert_close(nodes[node], whole[node], rtol=1e-12, atol=0)
    torch.testing.assert_close(nodes.stacked([5, 0]), whole[[5, 0]], rtol=1e-12, atol=0)
    assert len(kept) == 3  # rows 0, 3 and 5, each once
    assert not processed  # a truncating row is its kept tokens, scattered
    sampling.NodeDistributions(logits, Processing(0.7))[2]
    assert processed == [1]  # an untruncated one its softmax


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "framework"])
@pytest.mark.parametrize("scale", [8.0, 3.0, 0.1])
def test_kept_tokens_are_the_processed_row_without_its_zeros(
    scale: float, kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same tokens in rank order and the same probabilities up to rounding (bit for bit
    without the CPU kernel), from a prefix or the whole sort; None for a row that does not
    truncate."""
    if kernel and bf16_kernel.library() is None:
        pytest.skip("the CPU kernels do not build here")
    if not kernel:
        monkeypatch.setattr(bf16_kernel, "kept_set", lambda *args: None)
    logits = peaked_logits(len(ROWS), seed=5, scale=scale)
    expected = processed_probs(logits, ROWS)
    for row, setting, dense in zip(logits, ROWS, expected, strict=True):
        kept = kept_tokens(row, setting)
        if not setting.truncates(VOCAB):
            assert kept is None
            continue
        assert kept is not None
        ids, probs = kept
        assert int((dense > 0).sum()) == len(ids)
        torch.testing.assert_close(probs, dense[ids], rtol=1e-12 if kernel else 0, atol=0)
        assert torch.equal(probs, probs.sort(descending=True).values)


@pytest.mark.parametrize(
    ("setting", "scale"),
    [(Processing(0.7, 0.9), 3.0), (Processing(1.0), 1.0), (Processing(1.0, 0.95), 0.1)],
    ids=["prefix", "raced-logits", "sorted"],
)
def test_a_node_draw_samples_its_processed_row(setting: Processing, scale: float) -> None:
    """``NodeDistributions.draw`` by each of its ways (inverse CDF over the kept tokens of a
    prefix or of the sort, the race from the logits under a drawn key) samples the processed
    distribution (chi-square over the likeliest tokens and the rest together)."""
    logits = peaked_logits(1, seed=6, scale=scale)
    nodes = sampling.NodeDistributions(logits, setting)
    probs = processed_probs(logits, [setting])[0]
    top = torch.topk(probs, 8).indices
    bucket = torch.full((VOCAB,), 8, dtype=torch.long)
    bucket[top] = torch.arange(8)
    generator = torch.Generator().manual_seed(7)
    draws = 4000
    counts = torch.bincount(
        torch.tensor([bucket[nodes.draw(0, generator)] for _ in range(draws)]), minlength=9
    )
    expected = torch.zeros(9, dtype=torch.float64).index_add_(0, bucket, probs) * draws
    keep = expected > 0
    assert counts[~keep].sum() == 0
    assert chisquare(counts[keep].double().numpy(), expected[keep].numpy()).pvalue > 1e-3
