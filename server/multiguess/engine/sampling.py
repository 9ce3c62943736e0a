"""Turning logits into the distribution a request samples from (temperature, top-k, top-p).

The same processing defines the target's distribution (the truth speculation must preserve)
and the draft's proposal distribution.
"""

from __future__ import annotations

import torch


def processed_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """Probabilities over the last dimension after temperature, then top-k, then top-p.

    Top-p keeps the smallest set of most probable tokens whose mass reaches ``top_p`` (ties at
    the boundary resolved by sort order, as in transformers).
    """
    scores = logits.double() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
