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

from multiguess.engine.backends import torch_layers
from multiguess.engine.backends.cuda.attention import attention
from multiguess.engine.backends.cuda.graphs import StaticForward
from multiguess.engine.linear import Projection
from multiguess.engine.placement import Placement

if TYPE_CHECKING:
    from multiguess.engine.backends.parts import ModelParts


class TorchBackend:
    name = label = "torch"
    projection = Projection
    cost_tokens = 128  # GPUs verify tens of tokens for about the price of one
    attends_unmasked = True
    pages_kv = True
    batched_acceptance = True  # the host reads a step's outcome once
    ragged_rows = False  # padded trees keep the shapes its graphs and batched acceptance read

    def __init__(self, dtype: torch.dtype) -> None:
        self.attn_dtype = dtype

    @staticmethod
    def attention(
        q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        """One attention call as every layer makes it (``cuda/attention.py``), for checks that
        run its paths alone."""
        return attention(q, keys, values, mask, scale)

    def kv_dtype(self, runner: ModelParts) -> torch.dtype:
        return self.attn_dtype

    def attach(self, runner: ModelParts) -> None:
        """Nothing to prepare: the projections are plain fused products."""

    def mask(self, visible: torch.Tensor, plain: bool) -> torch.Tensor | None:
        return None if plain else visible

    def run_layers(self, runner: ModelParts, x: torch.Tensor, at: Placement) -> torch.Tensor:
        return torch_layers.run_layers(runner, x, at, attention)

    def static_forward(self, runner: ModelParts, max_width: int) -> StaticForward:
        return StaticForward(runner, max_width)
