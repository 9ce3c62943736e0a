"""Linear layers for the native forward: fused where inputs are shared, prepacked on CPUs.

A decode step is a chain of matrix-vector products over weights that do not fit in cache, so
its speed is how fast the kernel streams weights from memory. On this machine (2 cores, AVX512
bf16) oneDNN with weights reordered once into its blocked layout streams 1.5–1.9× faster than
``F.linear`` on the plain row-major weight (docs/ENGINE.md); in bf16 multiguess's own kernel
(``bf16_kernel.py``) streams faster still and is used where it builds. ``eager=True`` keeps
plain ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from multiguess.engine import bf16_kernel, huge_pages


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The supported families' RMSNorm, bitwise, in one fused call instead of eight module ops."""
    normed = torch.rms_norm(x.float(), (x.shape[-1],), None, norm.variance_epsilon)
    return norm.weight * normed.to(x.dtype)


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN prepacked weights: CPU only, fp32 or (with hardware support) bf16."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


CACHE_ATTRIBUTE = "_multiguess_projection"


class Projection:
    """One or more Linear layers reading the same input, run as one matmul.

    Fusing re-points each original layer's weight to a view of the fused tensor, so the model
    keeps working as a transformers module and no memory is duplicated. A prepacked weight is
    a second copy, in the bf16 kernel's panels where it runs and in oneDNN's layout otherwise
    (the plain one stays for the transformers model).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int], pack: bool) -> None:
        self.weight = weight
        self.bias = None if bias is None else bias.contiguous()
        self.sizes = sizes
        self.panels = bf16_kernel.pack(weight) if pack and bf16_kernel.usable(weight) else None
        self.panels_placed = False  # moved by ``place_panels``: never moved again
        self.packed = None
        if pack and self.panels is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    @classmethod
    def of(cls, linears: list[torch.nn.Module], pack: bool) -> Projection | None:
        """None when a layer is not a plain Linear (e.g. dynamically quantized): call it as is.

        Built once per model: runners over the same model (the benchmark's) share it, so the
        fused and packed weights exist once."""
        if not all(type(m) is torch.nn.Linear for m in linears):
            return None
        key = (tuple(id(m) for m in linears), pack)
        cached = getattr(linears[0], CACHE_ATTRIBUTE, None)
        if cached is not None and cached[0] == key:
            return cached[1]
        projection = cls._build(linears, pack)
        setattr(linears[0], CACHE_ATTRIBUTE, (key, projection))
        return projection

    @classmethod
    def rows(cls, linear: torch.nn.Module, rows: torch.Tensor, pack: bool) -> Projection | None:
        """Only some output rows of a Linear layer (a copy of them), e.g. an LM head over a
        subset of the vocabulary; None when the layer is not a plain Linear."""
        if type(linear) is not torch.nn.Linear:
            return None
        rows = rows.to(linear.weight.device)
        bias = None if linear.bias is None else linear.bias.detach()[rows]
        return cls(linear.weight.detach()[rows].contiguous(), bias, [len(rows)], pack)

    @classmethod
    def _build(cls, linears: list[torch.nn.Module], pack: bool) -> Projection:
        if len(linears) == 1:
            (m,) = linears
            return cls(m.weight.detach(), None if m.bias is None else m.bias.detach(), [m.out_features], pack)
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
        return cls(weight, bias, [m.out_features for m in linears], pack)

    def __call__(
        self,
        x: torch.Tensor,
        norm: torch.nn.Module | None = None,
        gated: bool = False,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The product, optionally of ``rms_norm(norm, x)`` or of ``silu(gate) * up`` (x holding
        gate then up), plus ``residual``: one kernel call where the bf16 kernel runs."""
        if norm is not None and (self.panels is None or norm.weight.dtype != torch.bfloat16):
            x, norm = rms_norm(norm, x), None
        if self.panels is not None:
            weight = None if norm is None else (norm.weight.contiguous(), norm.variance_epsilon)
            return bf16_kernel.matmul(
                self.panels, self.weight.shape[0], x, self.bias, weight, gated, residual
            )
        if gated:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        if self.packed is None:
            y = F.linear(x, self.weight, self.bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return y if residual is None else residual + y

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The fused layers' outputs, one per original layer."""
        return self(x).split(self.sizes, dim=-1)


def place_panels(projections: list[Projection | None]) -> None:
    """Move the bf16 panels of ``projections`` into one block on huge pages (``huge_pages.py``).

    Panels already placed stay where they are: kernels hold their addresses (a runner's layer
    structs), and runners over the same model share the projections."""
    todo = [p for p in projections if p is not None and p.panels is not None and not p.panels_placed]
    for projection, copy in zip(todo, huge_pages.together([p.panels for p in todo]), strict=True):
        projection.panels, projection.panels_placed = copy, True
