"""Projections with their weights repacked for CPUs: multiguess's bf16 panels, else oneDNN's.

A decode step is a chain of matrix-vector products over weights that do not fit in cache, so
its speed is how fast the kernel streams weights from memory. oneDNN streams a weight reordered
once into its blocked layout faster than ``F.linear`` streams the row-major one, and in bf16
multiguess's own kernel (``bf16_kernel.py``) streams faster still and is used where it builds
(docs/ENGINE.md has the measurements). The plain weight stays for the transformers model.
"""

from __future__ import annotations

import torch

from multiguess.engine.backends.cpu import bf16_kernel, huge_pages
from multiguess.engine.linear import Projection, rms_norm


def packing_supported(dtype: torch.dtype) -> bool:
    """Repacked weights: bf16 where multiguess's kernels run or oneDNN computes bf16 natively,
    fp32 where oneDNN runs."""
    if dtype == torch.bfloat16:
        return bf16_kernel.library() is not None or onednn_bf16()
    return dtype == torch.float32 and torch.backends.mkldnn.is_available()


def onednn_bf16() -> bool:
    """Whether oneDNN has bf16 instructions here (elsewhere it emulates them, slowly)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedProjection(Projection):
    """A ``Projection`` whose product runs on a second, repacked copy of the weight: the bf16
    kernel's panels where it runs (norm, gating and residual fused into the call), oneDNN's
    blocked layout otherwise (or the plain weight, for a bf16 one oneDNN would emulate)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]) -> None:
        super().__init__(weight, bias, sizes)
        self.panels = bf16_kernel.pack(weight) if bf16_kernel.usable(weight) else None
        self.panels_placed = False  # moved by ``place_panels``: never moved again
        reorder = self.panels is None and (weight.dtype != torch.bfloat16 or onednn_bf16())
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None) if reorder else None

    def __call__(
        self,
        x: torch.Tensor,
        norm: torch.nn.Module | None = None,
        gated: bool = False,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.panels is None:
            return super().__call__(x, norm, gated, residual)
        if norm is not None and norm.weight.dtype != torch.bfloat16:
            x, norm = rms_norm(norm, x), None
        weight = None if norm is None else (norm.weight.contiguous(), norm.variance_epsilon)
        return bf16_kernel.matmul(self.panels, self.weight.shape[0], x, self.bias, weight, gated, residual)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return super().product(x)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


def place_panels(projections: list[Projection | None]) -> None:
    """Move the bf16 panels of ``projections`` into one block on huge pages (``huge_pages.py``).

    Panels already placed stay where they are: kernels hold their addresses (a runner's layer
    structs), and runners over the same model share the projections."""
    todo = [
        p
        for p in projections
        if isinstance(p, PackedProjection) and p.panels is not None and not p.panels_placed
    ]
    for projection, copy in zip(todo, huge_pages.together([p.panels for p in todo]), strict=True):
        projection.panels, projection.panels_placed = copy, True
