"""The torch backend, for CUDA and any other torch device: plain fused projections, the model's
dtype for the cache and attention, and attention without a dense mask wherever one is not needed.

A dense additive mask rules out the fused flash kernels, so a forward in which every row sees
exactly its own prefix and itself (a decode step whose sequences have one length, or a chain
prefilled from position 0) attends without a mask; only trees and ragged batches carry one, as
a bool mask. A grouped-query decode folds each key/value head's query heads into its query
length, so one fused call reads the cache once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from multiguess.engine.backends import torch_layers
from multiguess.engine.linear import Projection
from multiguess.engine.placement import Placement

if TYPE_CHECKING:
    from multiguess.engine.runner import NativeRunner


def attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Queries ``[B, T, H, D]`` over cached ``[B, KV, L, D]``: ``[B, T, H * D]``.

    ``mask`` None means every row sees its prefix and itself: one query per sequence sees every
    cached key, a chain from position 0 is causal (L == T)."""
    batch, width, heads, dim = q.shape
    kv_heads = keys.shape[1]
    if mask is None and width == 1:
        folded = q.view(batch, kv_heads, heads // kv_heads, dim)
        out = F.scaled_dot_product_attention(folded, keys, values, scale=scale)
        return out.reshape(batch, 1, heads * dim)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2).reshape(batch, width, heads * dim)


class TorchBackend:
    name = label = "torch"
    projection = Projection
    cost_tokens = 128  # GPUs verify tens of tokens for about the price of one
    attends_unmasked = True

    def __init__(self, dtype: torch.dtype) -> None:
        self.attn_dtype = dtype

    def attach(self, runner: NativeRunner) -> None:
        """Nothing to prepare: the projections are plain fused products."""

    def mask(self, visible: torch.Tensor, plain: bool) -> torch.Tensor | None:
        return None if plain else visible

    def run_layers(self, runner: NativeRunner, x: torch.Tensor, at: Placement) -> torch.Tensor:
        return torch_layers.run_layers(runner, x, at, attention)
