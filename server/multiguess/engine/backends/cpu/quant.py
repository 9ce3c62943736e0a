"""Projections over weights kept in GGUF's block formats, run by the integer kernels.

The runner fuses layers that read one input (q/k/v, gate/up) into one product; for quantized
layers the fused weight is their blocks' rows concatenated, which the modules then view (no
copy kept twice). Norm, gating and residual run as torch ops around the product
(``Projection.__call__``); each is per row, as the product is, so a row's result never depends
on the rows beside it. Layers that are not quantized go to ``PackedProjection`` as before.
"""

from __future__ import annotations

import torch

from multiguess.engine.backends.cpu import quant_kernel
from multiguess.engine.backends.cpu.packed import PackedProjection
from multiguess.engine.linear import CACHE_ATTRIBUTE, Projection
from multiguess.models.quantized import QuantizedLinear


class QuantizedProjection(Projection):
    """One or more ``QuantizedLinear`` layers of one format and input width, as one product."""

    def __init__(self, blocks: torch.Tensor, kind: str, bias: torch.Tensor | None, sizes: list[int]) -> None:
        self.blocks, self.kind = blocks, kind
        self.bias = None if bias is None else bias.float().contiguous()
        self.sizes = sizes

    @staticmethod
    def fusable(linears: list[torch.nn.Module]) -> bool:
        first = linears[0]
        return (
            all(isinstance(m, QuantizedLinear) for m in linears)
            and all(m.kind == first.kind and m.in_features == first.in_features for m in linears)
            and quant_kernel.usable(first.kind)
        )

    @classmethod
    def of(cls, linears: list[torch.nn.Module]) -> Projection | None:
        """Quantized layers fused (cached on the first, as ``Projection.of`` does); plain Linears
        as ``PackedProjection``; None for a mix (each layer is then called as is)."""
        if not any(isinstance(m, QuantizedLinear) for m in linears):
            return PackedProjection.of(linears)
        if not cls.fusable(linears):
            return None
        key = (tuple(id(m) for m in linears), cls)
        cached = getattr(linears[0], CACHE_ATTRIBUTE, None)
        if cached is not None and cached[0] == key:
            return cached[1]
        projection = cls._fuse(linears)
        setattr(linears[0], CACHE_ATTRIBUTE, (key, projection))
        return projection

    @classmethod
    def _fuse(cls, linears: list[QuantizedLinear]) -> QuantizedProjection:
        sizes = [m.out_features for m in linears]
        if len(linears) == 1:
            (m,) = linears
            return cls(m.blocks, m.kind, m.bias, sizes)
        blocks = torch.cat([m.blocks for m in linears])
        bias = None
        if any(m.bias is not None for m in linears):
            bias = torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features) for m in linears])
        start = 0
        for m in linears:
            m.blocks = blocks[start : start + m.out_features]
            start += m.out_features
        return cls(blocks, linears[0].kind, bias, sizes)

    @classmethod
    def rows(cls, linear: torch.nn.Module, rows: torch.Tensor) -> Projection | None:
        if not isinstance(linear, QuantizedLinear):
            return PackedProjection.rows(linear, rows)
        if not cls.fusable([linear]):
            return None
        bias = None if linear.bias is None else linear.bias.detach()[rows]
        return cls(linear.blocks[rows].contiguous(), linear.kind, bias, [len(rows)])

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return quant_kernel.matmul(self.blocks, self.kind, x, self.bias).to(x.dtype)
