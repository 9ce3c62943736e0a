"""Turning logits into the distribution a request samples from (temperature, top-k, top-p).

The same processing defines the target's distribution (the truth speculation must preserve)
and the draft's proposal distribution. It runs once per step over every sampled row of the
batch, each row with its own request's settings.
"""

from __future__ import annotations

import hashlib

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Processing:
    temperature: float
    top_p: float = 1.0
    top_k: int = 0


def processed_probs(logits: torch.Tensor, rows: list[Processing]) -> torch.Tensor:
    """Float64 probabilities ``[N, V]`` after temperature, then top-k, then top-p, per row.

    Top-p keeps the smallest set of most probable tokens whose mass reaches ``top_p`` (ties at
    the boundary resolved by sort order, as in transformers).
    """
    vocab, device = logits.shape[-1], logits.device
    temperature = torch.tensor([r.temperature for r in rows], dtype=torch.float64, device=device)[:, None]
    scores = logits.double() / temperature
    if all(r.top_p >= 1.0 and not 0 < r.top_k < vocab for r in rows):
        return torch.softmax(scores, dim=-1)  # nothing to truncate: skip the sort
    top_k = torch.tensor([r.top_k if 0 < r.top_k < vocab else vocab for r in rows], device=device)
    top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float64, device=device)[:, None]
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    sorted_probs = torch.softmax(sorted_scores.masked_fill(ranks >= top_k[:, None], float("-inf")), dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter(-1, order, sorted_probs)


class Generators:
    """A sampled sequence's random streams, one per device it samples on, all from one seed.

    A generator samples only tensors on its own device, and a draft may live on another device
    than its target. Each device's stream is seeded from the seed and the device's name, so a
    seeded request repeats itself and two devices never share a stream."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._by_device: dict[torch.device, torch.Generator] = {}

    def on(self, device: torch.device) -> torch.Generator:
        generator = self._by_device.get(device)
        if generator is None:
            digest = hashlib.blake2b(f"{self.seed}:{device}".encode(), digest_size=8).digest()
            generator = torch.Generator(device=device).manual_seed(int.from_bytes(digest) >> 1)
            self._by_device[device] = generator
        return generator
