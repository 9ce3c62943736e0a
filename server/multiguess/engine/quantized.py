"""Weights kept in GGUF's quantized blocks: the formats, their decoding, the modules holding them.

A block format stores each row of an ``[out, in]`` weight as ``in / 32`` blocks (an fp16 scale,
sometimes an fp16 offset, and 32 integers of 8 or 4 bits) or, for the K formats, ``in / 256``
super-blocks of sub-blocks with their own small scales, so a row is a run of bytes that can be
concatenated, selected or permuted without decoding it. ``unpack`` reads any of them as
unsigned integers with a scale and an offset per group of 32 (Q6_K: 16) weights. ``QuantizedLinear`` keeps a weight
that way: the CPU backend's integer kernels read the blocks as they are; elsewhere ``forward``
decodes them first (a reference, not a fast path). ``quantize`` writes the same blocks from a
float weight, so a safetensors model can run quantized (``--quantization q8_0``).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from multiguess.engine.kquants import quantize_q4_k, quantize_q6_k

log = logging.getLogger(__name__)

# The formats multiguess reads and writes, by their ``--quantization`` names.
FORMATS = {
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
    "q4_1": GGMLQuantizationType.Q4_1,
    "q4_k": GGMLQuantizationType.Q4_K,
    "q6_k": GGMLQuantizationType.Q6_K,
}
GROUP = {"q8_0": 32, "q4_0": 32, "q4_1": 32, "q4_k": 32, "q6_k": 16}  # weights per scale
ZERO = {"q8_0": 128, "q4_0": 8, "q6_k": 32}  # weight = scale * (u - zero); the others scale * u + offset
BITS = {"q8_0": 8, "q4_0": 4, "q4_1": 4, "q4_k": 4, "q6_k": 8}  # bits holding u (Q6_K's 6 in a byte)
WRITERS = {"q4_k": quantize_q4_k, "q6_k": quantize_q6_k}  # formats the gguf package cannot write


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
    if kind == "q4_k":
        return unpack_q4_k(blocks)
    if kind == "q6_k":
        return unpack_q6_k(blocks)
    scale = half(blocks, 0)
    if kind == "q8_0":
        u = (blocks[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    elif kind == "q4_0":
        u = nibbles(blocks[..., 2:])
    else:
        u = nibbles(blocks[..., 4:])
    offset = half(blocks, 2) if kind == "q4_1" else -ZERO[kind] * scale
    return u.reshape(rows, -1), scale.reshape(rows, -1), offset.reshape(rows, -1)


def unpack_q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks ``[n, blocks, 144]``: fp16 d and dmin, 12 bytes of 6-bit scales and
    minimums of 8 sub-blocks, 128 bytes of nibbles (sub-block 2j low, 2j + 1 high)."""
    rows = blocks.shape[0]
    sc, m = (
        torch.from_numpy(t) for t in quants.Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12).numpy())
    )
    scale = half(blocks, 0) * sc.view(rows, -1, 8).float()
    offset = -(half(blocks, 2) * m.view(rows, -1, 8).float())
    qs = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)
    u = (qs >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 0x0F
    return u.reshape(rows, -1), scale.reshape(rows, -1), offset.reshape(rows, -1)


def unpack_q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K super-blocks ``[n, blocks, 210]``: 128 bytes of low nibbles, 64 of high 2-bit pairs,
    16 int8 scales of 16-weight sub-blocks, fp16 d; u is 6 bits, the zero 32."""
    rows = blocks.shape[0]
    ql = blocks[..., :128].reshape(rows, -1, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    qh = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32) >> torch.tensor(
        [0, 2, 4, 6], dtype=torch.uint8
    ).view(4, 1)
    u = (ql & 0x0F).reshape(rows, -1, 256) | ((qh & 0x03).reshape(rows, -1, 256) << 4)
    scale = half(blocks, 208) * blocks[..., 192:208].contiguous().view(torch.int8).float()
    return u.reshape(rows, -1), scale.reshape(rows, -1), (-ZERO["q6_k"] * scale).reshape(rows, -1)


def dequantize(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """Rows of quantized blocks ``[n, row_bytes]`` (uint8) as fp32 ``[n, in]``, as ggml decodes
    them (scale times integer, plus the offset where the format has one)."""
    return decode(*unpack(blocks, kind), kind)


def decode(u: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, kind: str) -> torch.Tensor:
    """``unpack``'s integers, scales and offsets as the fp32 weights ``dequantize`` gives."""
    rows, group = u.shape[0], GROUP[kind]
    u = u.view(rows, -1, group).float()
    if kind in ZERO:
        return (scale[..., None] * (u - ZERO[kind])).reshape(rows, -1)
    return (scale[..., None] * u + offset[..., None]).reshape(rows, -1)


def quantize(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """A float weight ``[out, in]`` as rows of ``kind`` blocks ``[out, row_bytes]`` (uint8),
    by ggml's own rounding (the ``gguf`` package's reference quantizer); Q4_K and Q6_K by the
    plain rounding of ``kquants``."""
    if kind not in FORMATS:
        raise ValueError(f"cannot quantize to {kind!r}; formats: {', '.join(FORMATS)}")
    row_bytes(kind, weight.shape[1])
    array = weight.detach().float().cpu().numpy()
    blocks = WRITERS[kind](array) if kind in WRITERS else quants.quantize(array, FORMATS[kind])
    return torch.from_numpy(np.ascontiguousarray(blocks))


Unpacked = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ``unpack``'s u, scales, offsets


class QuantizedLinear(torch.nn.Module):
    """A Linear layer whose weight stays in quantized blocks ``[out, row_bytes]``; the bias, if
    any, is a float tensor. ``forward`` decodes the weight on every call: backends with kernels
    for the format read ``blocks`` instead, and where they keep a copy of their own they
    ``release`` the blocks (one copy of the weight in memory, not two)."""

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
        self.source: Callable[[], Unpacked] | None = None

    def unpacked(self) -> Unpacked:
        """The weight as ``unpack`` reads it: from the blocks, or from the copy that replaced them."""
        if self.blocks is not None:
            return unpack(self.blocks, self.kind)
        if self.source is None:
            raise RuntimeError("the blocks were released without a source to read the weight from")
        return self.source()

    def release(self, source: Callable[[], Unpacked], held: torch.Tensor) -> None:
        """Drop the blocks: a backend holds the weight in ``held``, a layout of its own, and
        ``source`` reads it back (the same integers, scales and offsets) for whatever still needs
        the weight. ``held`` becomes a buffer (not saved), so the bytes a model's weights take
        are still its parameters and buffers (a tensor that several layers share counts once)."""
        self.source = source
        self.blocks = None
        self.register_buffer("held", held, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = decode(*self.unpacked(), self.kind).to(x.dtype)
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


def linear_formats(model: torch.nn.Module) -> collections.Counter[str]:
    """How many of ``model``'s linears keep their weights in each block format (none: floats)."""
    return collections.Counter(m.kind for m in model.modules() if isinstance(m, QuantizedLinear))


def format_for(kind: str, in_features: int) -> str:
    """``kind``, or for a K format whose super-blocks of 256 do not divide the row, the block
    format llama.cpp's quantizer also falls back to at about the same size (Q6_K: Q8_0; Q4_K:
    Q4_1, as multiguess has no Q5_0)."""
    if in_features % block_size(kind) == 0:
        return kind
    return FALLBACK[kind]


FALLBACK = {"q4_k": "q4_1", "q6_k": "q8_0"}


def quantize_linears(model: torch.nn.Module, kind: str) -> None:
    """Every Linear of a causal LM (decoder layers and LM head) replaced, in place, by a
    ``QuantizedLinear`` of its weight in ``kind`` (``format_for``: a K format falls back where
    its super-blocks do not fit the row, said in one log line); embeddings and norms stay float."""
    fallen: dict[str, int] = {}
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                bias = None if child.bias is None else child.bias.detach().clone()
                used = format_for(kind, child.in_features)
                if used != kind:
                    fallen[used] = fallen.get(used, 0) + 1
                blocks = quantize(child.weight, used)
                setattr(module, child_name, QuantizedLinear(blocks, used, child.in_features, bias))
    for used, count in fallen.items():
        log.warning(
            "%d linears in %s instead of %s: their inputs are not a multiple of 256", count, used, kind
        )
