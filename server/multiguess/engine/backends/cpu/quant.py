"""Projections over weights kept in GGUF's block formats, run by the integer kernels.

The runner fuses layers that read one input (q/k/v, gate/up) into one product; for quantized
layers the fused weight is their blocks' rows concatenated and repacked once into the kernel's
layout (``quant_kernel.layout``), after which the layers release their blocks (the weight is
held once). Norm, gating and residual run in the kernel's call, in fp32 (one call instead of a
handful of torch ops); each is per row, as the product is, and with bf16 activations a whole
layer runs in one call (``layer_weights``: ``multiguess_quant_layer``), with rotary, the
cache write and attention in the bf16 library's per-row kernels (torch's attention blocks by
the number of queries, so a tree node's bits would differ from its token decoded alone): a
row's result never depends on the rows beside it. Layers that are not quantized
go to ``PackedProjection`` as before.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from multiguess.engine.backends.cpu import bf16_kernel, quant_kernel
from multiguess.engine.backends.cpu.packed import PackedProjection
from multiguess.engine.linear import Projection, built_once
from multiguess.engine.quantized import QuantizedLinear

if TYPE_CHECKING:
    from multiguess.engine.backends.parts import ModelParts


class QuantizedProjection(Projection):
    """One or more ``QuantizedLinear`` layers of one format and input width, as one product,
    its weight repacked once for the kernel (``quant_kernel.layout``)."""

    def __init__(self, weight: quant_kernel.Packed, bias: torch.Tensor | None, sizes: list[int]) -> None:
        self.weight = weight
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
        """The layers' weights repacked as one; each layer then releases its blocks and reads its
        rows of the repacked weight where it is still called (``QuantizedLinear.release``), so
        the weight is held once."""
        sizes = [m.out_features for m in linears]
        bias = None
        if any(m.bias is not None for m in linears):
            bias = torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features) for m in linears])
        u, scale, offset = (torch.cat(parts) for parts in zip(*(m.unpacked() for m in linears), strict=True))
        weight = quant_kernel.layout(u, scale, offset, linears[0].kind)
        start = 0
        for m in linears:
            m.release(
                functools.partial(quant_kernel.unlayout, weight, start, start + m.out_features), weight.data
            )
            start += m.out_features
        return cls(weight, bias, sizes)

    @classmethod
    def rows(cls, linear: torch.nn.Module, rows: torch.Tensor) -> Projection | None:
        if not isinstance(linear, QuantizedLinear):
            return PackedProjection.rows(linear, rows)
        if not cls.fusable([linear]):
            return None
        bias = None if linear.bias is None else linear.bias.detach()[rows]
        u, scale, offset = linear.unpacked()
        return cls(quant_kernel.layout(u[rows], scale[rows], offset[rows], linear.kind), bias, [len(rows)])

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
    """Whether every layer can run in the layer kernel: quantized projections throughout, bf16
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


def layer_weights(runner: ModelParts, i: int) -> quant_kernel.QuantLayer:
    """Layer i's repacked weights, norms and cache, as the quantized layer kernel reads them
    (the projections hold the tensors it points to)."""
    layer = runner.layers[i]
    weights = {
        name: quant_kernel.QuantWeight.of(p.weight, p.bias)
        for name, p in (
            ("qkv", runner.qkv[i]),
            ("o", runner.o[i]),
            ("gate_up", runner.gate_up[i]),
            ("down", runner.down[i]),
        )
    }
    return quant_kernel.QuantLayer(
        input_norm=layer.input_layernorm.weight.data_ptr(),
        post_norm=layer.post_attention_layernorm.weight.data_ptr(),
        **weights,
        cache=runner.cache.kv[i].data_ptr(),
        eps=layer.input_layernorm.variance_epsilon,
        post_eps=layer.post_attention_layernorm.variance_epsilon,
        scale=runner.attention_scale(i),
    )
