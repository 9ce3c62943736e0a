"""Attention for the torch backend: fused kernels, with a mask only where one is needed.

A grouped-query decode folds each key/value head's query heads into its query length, so one
fused call reads the cache once; trees and ragged batches carry a bool mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
