"""Attention for the torch backend: one fused kernel per call, never the math fallback.

- A plain decode (one query per sequence, no mask) folds each key/value head's query heads
  into its query length, so one flash or memory-efficient call reads the cache once.
- A causal prefill from position 0 in half precision takes flash attention with grouped heads.
- On CUDA, everything that needs a mask (trees, ragged batches, graph replays) and a float32
  prefill goes through FlexAttention: the bool mask becomes a block mask (blocks no query sees
  are skipped, so a short sequence in a long batch costs its own length), grouped heads are
  read in place (``enable_gqa``), in the queries' dtype. SDPA with a mask and grouped heads
  would fall back to its math kernel there, which repeats keys and values to every query head
  and upcasts. The masked call is compiled (``torch.compile``; FlexAttention's fused kernel
  exists only compiled) once per query-width bucket (``WIDTHS``), with batch and cache length
  dynamic, so a few compiles serve every shape; each costs seconds the first time its bucket
  is met.
- Other devices keep SDPA, whose CPU kernels take masks and grouped heads fused. FlexAttention
  uncompiled computes the same arithmetic there, so the CPU tests check CUDA's path.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

HALF = (torch.float16, torch.bfloat16)
# The devices whose masked calls take FlexAttention; tests add "cpu" to run the engine through
# its arithmetic (uncompiled, and slow).
FLEX_DEVICES = {"cuda"}

# Uncompiled FlexAttention is the reference arithmetic tests run on the CPU on purpose.
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


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
    if q.device.type not in FLEX_DEVICES or (mask is None and q.dtype in HALF):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys,
            values,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return out.transpose(1, 2).reshape(batch, width, heads * dim)
    if mask is None:
        mask = causal(width, keys.shape[2], q.device).expand(batch, 1, width, -1)
    out = masked_kernel(q.device)(q.transpose(1, 2), keys, values, mask, scale)
    return out.transpose(1, 2).reshape(batch, width, heads * dim)


def causal(width: int, length: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, T, L]``: query i sees keys 0..i + L - T."""
    return torch.ones(width, length, dtype=torch.bool, device=device).tril(length - width)[None, None]


def masked_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``[B, H, T, D]`` queries over ``[B, KV, L, D]`` where ``mask`` ``[B, 1, T, L]`` is True:
    FlexAttention with the mask as a block mask and grouped heads read in place."""
    batch, _, width, _ = q.shape
    length = keys.shape[2]
    dense = mask[:, 0].expand(batch, width, length)

    def visible(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return dense[b, i, j]

    blocks = create_block_mask(visible, batch, None, width, length, device=q.device)
    return flex_attention(q, keys, values, block_mask=blocks, scale=scale, enable_gqa=True)


# Query widths are padded to one of these (then to powers of two) and compiled static: a few
# buckets, each in a dtype or two. Short queries share one bucket: FlexAttention's decoding
# kernel reads the cache once for all of them.
WIDTHS = (16, 128, 1024)
RECOMPILE_LIMIT = 64
_compiled: dict[str, Callable[..., torch.Tensor]] = {}


def masked_kernel(device: torch.device) -> Callable[..., torch.Tensor]:
    """``masked_attention`` as it is, or on CUDA ``bucketed`` over its compiled form (compiled
    once per process)."""
    if device.type != "cuda":
        return masked_attention
    if "cuda" not in _compiled:
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch 2.5
        setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
        _compiled["cuda"] = torch.compile(masked_attention, fullgraph=True)
    return bucketed


def width_bucket(width: int) -> int:
    """The first of ``WIDTHS`` that holds ``width``, else the next power of two."""
    return next((w for w in WIDTHS if width <= w), 1 << (width - 1).bit_length())


def bucketed(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """The compiled ``masked_attention`` with the query width padded to its bucket (padding rows
    see nothing and are dropped) and held static, so each bucket compiles once and picks its own
    kernel; batch and cache length are dynamic from the start."""
    width = q.shape[2]
    padded = width_bucket(width)
    if padded != width:
        q = F.pad(q, (0, 0, 0, padded - width))
        mask = F.pad(mask, (0, 0, 0, padded - width))
    torch._dynamo.mark_static(q, 2)
    for tensor, dims in ((q, (0,)), (keys, (0, 2)), (values, (0, 2)), (mask, (0, 3))):
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
    return _compiled["cuda"](q, keys, values, mask, scale)[:, :, :width]
