"""Weights kept in GGUF's quantized blocks: the formats, their decoding, the modules holding them.

A block format stores each row of an ``[out, in]`` weight as ``in / 32`` blocks (an fp16 scale,
sometimes an fp16 offset, and 32 integers of 8 or 4 bits), so a row is a run of bytes that can
be concatenated, selected or permuted without decoding it. ``QuantizedLinear`` keeps a weight
that way: the CPU backend's integer kernels read the blocks as they are; elsewhere ``forward``
decodes them first (a reference, not a fast path). ``quantize`` writes the same blocks from a
float weight, so a safetensors model can run quantized (``--quantization q8_0``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

# The formats multiguess reads and writes, by their ``--quantization`` names.
FORMATS = {
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
    "q4_1": GGMLQuantizationType.Q4_1,
}
BLOCK = 32  # weights per block, in every format above
GROUP = {"q8_0": 32, "q4_0": 32, "q4_1": 32}  # weights per scale
ZERO = {"q8_0": 128, "q4_0": 8}  # formats whose weight is scale * (u - zero); the others scale * u + offset
BITS = {"q8_0": 8, "q4_0": 4, "q4_1": 4}  # bits of the unsigned integers u (8 holds up to 8)


def format_of(qtype: GGMLQuantizationType) -> str | None:
    """The name of a GGUF tensor type among ``FORMATS``, or None when it is not one."""
    return next((name for name, known in FORMATS.items() if known == qtype), None)


def block_bytes(kind: str) -> int:
    return GGML_QUANT_SIZES[FORMATS[kind]][1]


def block_size(kind: str) -> int:
    return GGML_QUANT_SIZES[FORMATS[kind]][0]


def row_bytes(kind: str, in_features: int) -> int:
    """Bytes of one quantized row of ``in_features`` weights (a multiple of the format's block)."""
    size = block_size(kind)
    if in_features % size:
        raise ValueError(f"{kind} rows hold whole blocks of {size} weights; got {in_features}")
    return in_features // size * block_bytes(kind)


def half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 stored at byte ``at`` of every block ``[..., bytes]``, as fp32 ``[..., 1]``."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16).float()


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """16 bytes of 4-bit pairs per block into 32 values: the low nibbles are the first 16."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def unpack(blocks: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of quantized blocks ``[n, row_bytes]`` (uint8) as their unsigned integers ``u``
    ``[n, in]`` (uint8), scales and offsets ``[n, in / GROUP[kind]]`` (fp32): weight ``i`` is
    ``scale * u + offset`` of its group. For the formats in ``ZERO`` the offset is
    ``-zero * scale`` (exact: the zeros are powers of two)."""
    if kind not in FORMATS:
        raise ValueError(f"unknown quantized format {kind!r}; known: {', '.join(FORMATS)}")
    rows = blocks.shape[0]
    blocks = blocks.view(rows, -1, block_bytes(kind))
    scale = half(blocks, 0)
    if kind == "q8_0":
        u = (blocks[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    elif kind == "q4_0":
        u = nibbles(blocks[..., 2:])
    else:
        u = nibbles(blocks[..., 4:])
    offset = half(blocks, 2) if kind == "q4_1" else -ZERO[kind] * scale
    return u.reshape(rows, -1), scale.reshape(rows, -1), offset.reshape(rows, -1)


def dequantize(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """Rows of quantized blocks ``[n, row_bytes]`` (uint8) as fp32 ``[n, in]``, as ggml decodes
    them (scale times integer, plus the offset where the format has one)."""
    u, scale, offset = unpack(blocks, kind)
    rows, group = u.shape[0], GROUP[kind]
    u = u.view(rows, -1, group).float()
    if kind in ZERO:
        return (scale[..., None] * (u - ZERO[kind])).reshape(rows, -1)
    return (scale[..., None] * u + offset[..., None]).reshape(rows, -1)


def quantize(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """A float weight ``[out, in]`` as rows of ``kind`` blocks ``[out, row_bytes]`` (uint8),
    by ggml's own rounding (the ``gguf`` package's reference quantizer)."""
    if kind not in FORMATS:
        raise ValueError(f"cannot quantize to {kind!r}; formats: {', '.join(FORMATS)}")
    row_bytes(kind, weight.shape[1])
    array = weight.detach().float().cpu().numpy()
    return torch.from_numpy(np.ascontiguousarray(quants.quantize(array, FORMATS[kind])))


class QuantizedLinear(torch.nn.Module):
    """A Linear layer whose weight stays in quantized blocks ``[out, row_bytes]``; the bias, if
    any, is a float tensor. ``forward`` decodes the weight on every call: backends with kernels
    for the format read ``blocks`` instead."""

    def __init__(self, blocks: torch.Tensor, kind: str, in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        if blocks.dtype != torch.uint8 or blocks.shape[1] != row_bytes(kind, in_features):
            raise ValueError(
                f"{kind} blocks for {in_features} inputs must be uint8 rows of {row_bytes(kind, in_features)} bytes"
            )
        self.kind = kind
        self.in_features = in_features
        self.out_features = blocks.shape[0]
        self.register_buffer("blocks", blocks.contiguous())
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = dequantize(self.blocks, self.kind).to(x.dtype)
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.kind}"


class QuantizedEmbedding(torch.nn.Module):
    """An embedding table kept in quantized blocks: only the rows looked up are decoded."""

    def __init__(self, blocks: torch.Tensor, kind: str, dim: int, dtype: torch.dtype):
        super().__init__()
        row_bytes(kind, dim)
        self.kind, self.dim, self.dtype = kind, dim, dtype
        self.register_buffer("blocks", blocks.contiguous())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize(self.blocks[ids.reshape(-1)], self.kind).to(self.dtype)
        return rows.view(*ids.shape, self.dim)


def quantize_linears(model: torch.nn.Module, kind: str) -> None:
    """Every Linear of a causal LM (decoder layers and LM head) replaced, in place, by a
    ``QuantizedLinear`` of its weight in ``kind``; embeddings and norms stay float."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                bias = None if child.bias is None else child.bias.detach().clone()
                setattr(
                    module,
                    child_name,
                    QuantizedLinear(quantize(child.weight, kind), kind, child.in_features, bias),
                )
