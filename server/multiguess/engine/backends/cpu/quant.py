"""Projections over weights kept in GGUF's block formats, run by the integer kernels.

The runner fuses layers that read one input (q/k/v, gate/up) into one product; for quantized
layers the fused weight is their blocks' rows concatenated and repacked once into the kernel's
layout (``quant_kernel.repack``). Norm, gating and residual run in the kernel's call, in fp32 (one call instead of a handful of
torch ops); each is per row, as the product is, and with bf16 activations
``run_layers`` takes rotary, the cache write and attention to the bf16 library's per-row
kernels, so a row's result never depends on the rows beside it. Layers that are not quantized
go to ``PackedProjection`` as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from multiguess.engine.backends.cpu import bf16_kernel, quant_kernel
from multiguess.engine.backends.cpu.packed import PackedProjection
from multiguess.engine.linear import Projection, built_once
from multiguess.engine.placement import Placement
from multiguess.engine.quantized import QuantizedLinear

if TYPE_CHECKING:
    from multiguess.engine.backends.parts import ModelParts


class QuantizedProjection(Projection):
    """One or more ``QuantizedLinear`` layers of one format and input width, as one product,
    its weight repacked once for the kernel (``quant_kernel.repack``)."""

    def __init__(self, blocks: torch.Tensor, kind: str, bias: torch.Tensor | None, sizes: list[int]) -> None:
        self.weight = quant_kernel.repack(blocks, kind)
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
        return built_once(linears, cls, lambda: cls._fuse(linears))

    @classmethod
    def _fuse(cls, linears: list[QuantizedLinear]) -> QuantizedProjection:
        sizes = [m.out_features for m in linears]
        bias = None
        if any(m.bias is not None for m in linears):
            bias = torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features) for m in linears])
        return cls(torch.cat([m.blocks for m in linears]), linears[0].kind, bias, sizes)

    @classmethod
    def rows(cls, linear: torch.nn.Module, rows: torch.Tensor) -> Projection | None:
        if not isinstance(linear, QuantizedLinear):
            return PackedProjection.rows(linear, rows)
        if not cls.fusable([linear]):
            return None
        bias = None if linear.bias is None else linear.bias.detach()[rows]
        return cls(linear.blocks[rows].contiguous(), linear.kind, bias, [len(rows)])

    def __call__(
        self,
        x: torch.Tensor,
        norm: torch.nn.Module | None = None,
        gated: bool = False,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The product with norm, gating and residual in the kernel call (fp32 inside)."""
        weight = None if norm is None else (norm.weight, norm.variance_epsilon)
        return quant_kernel.matmul(self.weight, x, self.bias, weight, gated, residual).to(x.dtype)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return quant_kernel.matmul(self.weight, x, self.bias).to(x.dtype)


def layers_supported(runner: ModelParts) -> bool:
    """Whether every layer can run ``run_layers``: quantized projections throughout, bf16
    activations (the rotary and attention kernels' dtype), pre-norm SiLU-gated layers without
    q/k norms, a head width the attention kernel holds."""
    projections = (*runner.qkv, *runner.o, *runner.gate_up, *runner.down)
    return (
        runner.dtype == torch.bfloat16
        and runner.silu_gated
        and all(isinstance(p, QuantizedProjection) for p in projections)
        and not hasattr(runner.layers[0].self_attn, "q_norm")
        and bf16_kernel.attention_supported(runner.head_dim)
    )


def run_layers(runner: ModelParts, x: torch.Tensor, at: Placement) -> torch.Tensor:
    """Every layer on bf16 ``x`` ``[B, T, D]``: quantized products, and rotary, cache write and
    attention in the bf16 library's kernels, each row computed alone (torch's attention blocks
    by the number of queries, so a tree node's bits would differ from its token decoded alone)."""
    cos, sin = (table[:, :, 0].contiguous() for table in at.rope)
    mask, slots = at.mask[:, 0].contiguous(), torch.tensor(at.slots)
    starts = at.write_from.to(torch.int64).contiguous()
    batch, width = x.shape[:2]
    for i, layer in enumerate(runner.layers):
        if at.captured is not None and i in at.captured:
            at.captured[i] = x.clone()
        qkv = runner.qkv[i](x, norm=layer.input_layernorm).view(batch, width, -1, runner.head_dim)
        cache = runner.cache.kv[i]
        queries = bf16_kernel.rope_into_cache(
            qkv.contiguous(), cos, sin, cache, slots, starts, runner.num_heads
        )
        out = bf16_kernel.attention(queries, cache, slots, mask, runner.attention_scale(i), at.length)
        h = runner.o[i](out, residual=x)
        x = runner.down[i](runner.gate_up[i](h, norm=layer.post_attention_layernorm), gated=True, residual=h)
    return x
