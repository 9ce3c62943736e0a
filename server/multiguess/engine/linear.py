"""Fused linear layers for the native forward: one matmul where several layers share an input.

q/k/v and gate/up read the same normed input, so each group runs as one product over a
concatenated weight. Device families subclass ``Projection`` where they keep the weight in a
layout of their own (``backends/cpu/packed.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

CACHE_ATTRIBUTE = "_multiguess_projection"


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The supported families' RMSNorm, bitwise, in one fused call instead of eight module ops."""
    normed = torch.rms_norm(x.float(), (x.shape[-1],), None, norm.variance_epsilon)
    return norm.weight * normed.to(x.dtype)


class Projection:
    """One or more Linear layers reading the same input, run as one matmul.

    Fusing re-points each original layer's weight to a view of the fused tensor, so the model
    keeps working as a transformers module and no memory is duplicated.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]) -> None:
        self.weight = weight
        self.bias = None if bias is None else bias.contiguous()
        self.sizes = sizes

    @classmethod
    def of(cls, linears: list[torch.nn.Module]) -> Projection | None:
        """None when a layer is not a plain Linear (e.g. dynamically quantized): call it as is.

        Built once per model and kind: runners over the same model (the benchmark's) share it,
        so the fused (and any repacked) weights exist once."""
        if not all(type(m) is torch.nn.Linear for m in linears):
            return None
        return built_once(linears, cls, lambda: cls._build(linears))

    @classmethod
    def rows(cls, linear: torch.nn.Module, rows: torch.Tensor) -> Projection | None:
        """Only some output rows of a Linear layer (a copy of them), e.g. an LM head over a
        subset of the vocabulary; None when the layer is not a plain Linear."""
        if type(linear) is not torch.nn.Linear:
            return None
        rows = rows.to(linear.weight.device)
        bias = None if linear.bias is None else linear.bias.detach()[rows]
        return cls(linear.weight.detach()[rows].contiguous(), bias, [len(rows)])

    @classmethod
    def _build(cls, linears: list[torch.nn.Module]) -> Projection:
        if len(linears) == 1:
            (m,) = linears
            return cls(m.weight.detach(), None if m.bias is None else m.bias.detach(), [m.out_features])
        with torch.no_grad():
            weight = torch.cat([m.weight for m in linears])
            bias = None
            if any(m.bias is not None for m in linears):
                bias = torch.cat(
                    [m.bias if m.bias is not None else weight.new_zeros(m.out_features) for m in linears]
                )
            start = 0
            for m in linears:
                rows = m.out_features
                m.weight = torch.nn.Parameter(weight[start : start + rows], requires_grad=False)
                if m.bias is not None:
                    m.bias = torch.nn.Parameter(bias[start : start + rows], requires_grad=False)
                start += rows
        return cls(weight, bias, [m.out_features for m in linears])

    def __call__(
        self,
        x: torch.Tensor,
        norm: torch.nn.Module | None = None,
        gated: bool = False,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The product, optionally of ``rms_norm(norm, x)`` or of ``silu(gate) * up`` (x holding
        gate then up), plus ``residual``."""
        if norm is not None:
            x = rms_norm(norm, x)
        if gated:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        y = self.product(x)
        return y if residual is None else residual + y

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The fused layers' outputs, one per original layer."""
        return self(x).split(self.sizes, dim=-1)


def built_once(linears: list[torch.nn.Module], kind: type, build: Callable[[], Projection]) -> Projection:
    """``build()``'s projection of ``linears``, made once per model and kind: it is cached on the
    first layer, so runners over the same model share the fused (and any repacked) weights."""
    key = (tuple(id(m) for m in linears), kind)
    cached = getattr(linears[0], CACHE_ATTRIBUTE, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    projection = build()
    setattr(linears[0], CACHE_ATTRIBUTE, (key, projection))
    return projection
