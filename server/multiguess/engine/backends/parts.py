"""What a backend reads of the runner it serves: the model's parts, its shapes and its KV cache.

A protocol, so that backends depend on this interface and not on ``NativeRunner``, which
implements it and chooses its backend: the runner sits above the backends, never beside them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from multiguess.engine.kv_cache import KVCache
from multiguess.engine.linear import Projection
from multiguess.engine.placement import Rope


class ModelParts(Protocol):
    device: torch.device
    dtype: torch.dtype  # the model's
    attn_dtype: torch.dtype  # the KV cache's and attention's
    layers: list[torch.nn.Module]  # the model's decoder layers (norms, attention, MLP modules)
    embed: torch.nn.Module
    norm: torch.nn.Module
    rope: Rope  # the rotary tables of a forward's positions
    lm_head: torch.nn.Module
    # Fused projections per layer (None where a layer is not a plain Linear: call it as is).
    qkv: list[Projection | None]
    o: list[Projection | None]
    gate_up: list[Projection | None]
    down: list[Projection | None]
    head: Projection | None
    cache: KVCache
    num_heads: int
    num_kv_heads: int
    head_dim: int
    capacity: int  # tokens per cache slot
    vocab_size: int
    head_vocab: torch.Tensor | None  # the tokens the head scores (logit columns), None: all
    silu_gated: bool

    def attention_scale(self, i: int) -> float:
        """Layer ``i``'s softmax scale."""
        ...
