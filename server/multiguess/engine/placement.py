"""Where one forward's tokens go: rotary tables, the region attention mask, cache places.

Device-neutral geometry shared by every backend (``engine/backends``): a batch of token trees,
each placed after its sequence's prefix, attends to prefix + its own ancestors.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

_TableKey = tuple[int, torch.dtype, torch.device]
_fixed_tables: weakref.WeakKeyDictionary[
    torch.nn.Module, dict[_TableKey, tuple[torch.Tensor, torch.Tensor]]
] = weakref.WeakKeyDictionary()


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and a sign-folded ``sin`` for ``apply_rotary``, broadcast over heads of [B, T, H, D]."""
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos[:, :, None], signed[:, :, None]


def fixed_tables(
    rotary: torch.nn.Module, length: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_tables`` of every position below ``length``, ``[length, 1, D]`` each, computed
    once per rotary module, length, dtype and device: every runner over one model rotates by the
    same bits, whatever torch's elementwise kernels return on a later evaluation (docs/ENGINE.md)."""
    tables = _fixed_tables.setdefault(rotary, {})
    key = (length, dtype, device)
    if key not in tables:
        like = torch.empty(0, dtype=dtype, device=device)
        cos, sin = rotary_tables(*rotary(like, torch.arange(length, device=device)[None]))
        tables[key] = cos[0], sin[0]
    return tables[key]


class Rope:
    """A forward's rotary tables (``rotary_tables``) from the model's ``rotary`` module: where
    the rope is fixed in advance, gathered from tables of every position below ``length``
    computed once per model (``fixed_tables``), instead of cos and sin evaluated and signs
    folded for every forward; where it rescales with the sequence (dynamic, longrope),
    evaluated for each forward."""

    def __init__(
        self, rotary: torch.nn.Module, length: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.rotary = rotary
        self.table: tuple[torch.Tensor, torch.Tensor] | None = None
        kind = getattr(rotary, "rope_type", "default")
        if "dynamic" not in kind and kind != "longrope":
            self.table = fixed_tables(rotary, length, dtype, device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables at ``positions`` ``[B, T]`` for ``x``'s dtype and device: ``[B, T, 1, D]``."""
        if self.table is None:
            return rotary_tables(*self.rotary(x, positions))
        return self.table[0][positions], self.table[1][positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin``, bitwise (``(-a) * s == a * (-s)``), with
    the negation folded into the table once per forward instead of once per layer."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


def region_attention_mask(prefix_lens: torch.Tensor, visible: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, 1, T, length]`` bool attention mask over a cache of ``length`` positions.

    Sequence b's committed prefix is cache ``[0, prefix_lens[b])``; after it lies a *region*
    of tree nodes (this forward's and, for a drafter growing a tree level by level, earlier
    levels'). Input row i sees the whole prefix and region column j where ``visible[b, i, j]``.
    """
    batch, width, region = visible.shape
    rel = torch.arange(length, device=prefix_lens.device)[None, :] - prefix_lens[:, None]
    in_region = (rel >= 0) & (rel < region)
    cols = rel.clamp(0, region - 1)[:, None, :].expand(batch, width, length)
    return ((rel < 0)[:, None, :] | (visible.gather(2, cols) & in_region[:, None, :]))[:, None]


def sees_only_its_own(
    prefix_lens: list[int], write_from: torch.Tensor, visible: torch.Tensor, length: int
) -> bool:
    """Whether each row sees exactly its prefix and itself over all ``length`` cached positions:
    one token per sequence after prefixes of one length, or one chain written from position 0.
    Such a forward needs no mask (a decode step) or only causality (a prefill)."""
    width = visible.shape[1]
    if len(set(prefix_lens)) != 1 or visible.shape[2] != width or prefix_lens[0] + width != length:
        return False
    if width > 1 and prefix_lens[0] != 0:
        return False
    causal = torch.ones(width, width, dtype=torch.bool, device=visible.device).tril()
    return bool((write_from == prefix_lens[0]).all()) and bool((visible == causal).all())


class Placement(NamedTuple):
    """Where one forward's tokens go: rotary tables ``[B, T, 1, D]``, the sequences' slots, the
    cache row each starts writing at, the backend's attention mask (``[B, 1, T, L]``, or None
    where the backend attends without one) and the attended length L. ``captured``, when given,
    receives a copy of the hidden states ``[B, T, D]`` entering each layer it has a key for
    (transformers' ``output_hidden_states[i]``): the features a drafter such as EAGLE-3 reads."""

    rope: tuple[torch.Tensor, torch.Tensor]
    slots: list[int]
    write_from: torch.Tensor
    mask: torch.Tensor | None
    length: int
    captured: dict[int, torch.Tensor | None] | None = None
