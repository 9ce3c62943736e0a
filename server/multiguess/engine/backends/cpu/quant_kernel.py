"""Integer products over quantized weights on CPUs, compiled from C on first use.

A decode step over quantized weights waits on memory: Q4_1 blocks are 0.625 bytes a weight
against bf16's 2, so streaming them as they are, instead of dequantized, reads 3.2x fewer
bytes. ``repack`` rewrites a weight's blocks once, at load, into the kernel's layout (tiles of
16 weight rows interleaved four inputs at a time, integers unsigned, one header of scales and
offsets per block); ``kernels/quant_kernels.c`` quantizes each row of the input to int8 blocks
once per call (as llama.cpp does) and multiplies them with the weights' integers (AVX512-VNNI
``vpdpbusd``, AVX-VNNI, AVX2 ``vpmaddubsw``/``vpmaddwd``, or a portable loop), each row
independently of the others, so a row's result is the same bits in a one-token step and inside
a verified tree; the rows of a step share each pass over a tile. Built and cached like the bf16
kernels (``bf16_kernel.py``: ``Sources``), in the variants below; ``MULTIGUESS_QUANT_KERNEL=0``
switches it off (quantized linears then decode their weights on every call).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time
from dataclasses import dataclass

import torch

from multiguess.engine.backends.cpu import bf16_kernel
from multiguess.engine.backends.cpu.bf16_kernel import KERNELS, Sources, Variant, open_library
from multiguess.engine.quantized import BITS, FORMATS, GROUP, Unpacked, quantize, unpack

log = logging.getLogger(__name__)

AVX2 = ("-mavx2", "-mfma", "-mf16c")
QUANT = Sources(
    "quant_kernels",
    (KERNELS / "quant_kernels.c",),
    (KERNELS / "layer_step.h",),
    {  # best first
        "avx512_vnni": Variant(
            frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "f16c"}),
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c"),
        ),
        "avx_vnni": Variant(frozenset({"avx2", "fma", "f16c", "avx_vnni"}), (*AVX2, "-mavxvnni")),
        "avx2": Variant(frozenset({"avx2", "fma", "f16c"}), AVX2),
        "portable": Variant(frozenset(), ()),
    },
    "MULTIGUESS_QUANT_KERNEL",
)
VARIANT = "MULTIGUESS_QUANT_VARIANT"  # a variant's name, or auto (measured)
TILE = 16  # weight rows interleaved in one tile (quant_kernels.c: TILE)
QK = 32  # inputs per block of the layout


@dataclass(frozen=True)
class Packed:
    """A weight ``[out_features, in_features]`` in the kernel's layout (``repack``)."""

    data: torch.Tensor  # uint8, ceil(out / 16) tiles of in / 32 blocks
    bits: int  # 4 or 8 bits a weight
    groups: int  # scale groups a block of 32: 1, or 2 of 16 inputs
    wide: bool  # header in fp32 (else fp16)
    out_features: int
    in_features: int


class QuantWeight(ctypes.Structure):
    """``multiguess_quant_weight``: a repacked weight and its bias, as the kernels read it."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("bits", ctypes.c_int),
        ("groups", ctypes.c_int),
        ("wide", ctypes.c_int),
    ]

    @classmethod
    def of(cls, weight: Packed, bias: torch.Tensor | None) -> QuantWeight:
        """The view of ``weight`` and fp32 ``bias``: both must outlive it."""
        return cls(
            weight.data.data_ptr(),
            None if bias is None else bias.data_ptr(),
            weight.out_features,
            weight.in_features,
            weight.bits,
            weight.groups,
            int(weight.wide),
        )


class QuantLayer(ctypes.Structure):
    """``multiguess_quant_layer_weights``: one decoder layer's weights, norms and cache."""

    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        *[(name, QuantWeight) for name in ("qkv", "o", "gate_up", "down")],
        ("cache", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("post_eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels (``chosen_variant``), or None (and one log line saying why) where
    they cannot be used."""
    return variant_library(chosen_variant())


@functools.cache
def variant_library(variant: str | None) -> ctypes.CDLL | None:
    lib = open_library(
        QUANT,
        variant,
        "quantized linears decode their weights on every call (slow)",
        "quantized kernels unavailable, decoding weights on every call",
    )
    if lib is None:
        return None
    lib.multiguess_quant_matmul.argtypes = [
        ctypes.POINTER(QuantWeight),
        *[ctypes.c_void_p] * 2,
        ctypes.c_int64,
        *[ctypes.c_int] * 2,
        ctypes.c_void_p,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    lib.multiguess_quant_matmul.restype = ctypes.c_int
    lib.multiguess_quant_layer.argtypes = [ctypes.POINTER(QuantLayer), *[ctypes.c_void_p] * 4]
    lib.multiguess_quant_layer.restype = ctypes.c_int
    return lib


@functools.cache
def chosen_variant() -> str | None:
    """The variant this process runs, once for all its products (so a step and a tree share
    their arithmetic): ``$MULTIGUESS_QUANT_VARIANT`` names one, else among the vector variants
    this CPU runs the fastest at a Q4_1 product of 1 and of 8 rows, measured (256-bit AVX-VNNI
    may beat 512-bit AVX512-VNNI where the CPU splits 512-bit work)."""
    runnable = [name for name, variant in QUANT.variants.items() if variant.needs <= bf16_kernel.cpu_flags()]
    setting = os.environ.get(VARIANT, "auto")
    if setting != "auto":
        if setting not in runnable:
            raise ValueError(f"{VARIANT}={setting!r} does not run here; this CPU runs: {', '.join(runnable)}")
        return setting
    vector = [name for name in runnable if name != "portable"]
    if len(vector) < 2:
        return runnable[0] if runnable else None
    seconds = product_seconds(vector)
    chosen = min(seconds, key=lambda name: seconds[name])
    log.info(
        "quantized kernels: %s (%s)", chosen, ", ".join(f"{n} {1000 * t:.2f} ms" for n, t in seconds.items())
    )
    return chosen


def product_seconds(variants: list[str], repeats: int = 7) -> dict[str, float]:
    """Per variant, the fastest of ``repeats`` Q4_1 products by an 8192 x 4096 weight (21 MiB:
    streamed from memory, as a decode step streams a model) of 1 row plus that of 8 rows; inf
    where the variant does not build. The variants take turns round by round, so a burst of
    other work on the cores slows one sample, not one variant."""
    libraries = {name: variant_library(name) for name in variants}
    generator = torch.Generator().manual_seed(0)
    blocks = quantize(torch.randn(256, 4096, generator=generator), "q4_1")
    weight = repack(blocks.repeat(32, 1), "q4_1")
    rows = {count: torch.randn(count, 4096, generator=generator).to(torch.bfloat16) for count in (1, 8)}
    best = {(name, count): float("inf") for name, lib in libraries.items() if lib for count in rows}
    for _ in range(repeats):
        for name, count in best:
            start = time.perf_counter()
            product(libraries[name], weight, rows[count], None)
            best[name, count] = min(best[name, count], time.perf_counter() - start)
    return {name: sum(best.get((name, c), float("inf")) for c in rows) for name in variants}


def usable(kind: str) -> bool:
    """Whether the kernels run here and read this format."""
    return kind in FORMATS and library() is not None


def exact_in_half(values: torch.Tensor) -> bool:
    return bool(torch.equal(values.half().float(), values))


def repack(blocks: torch.Tensor, kind: str) -> Packed:
    """Rows of ``kind`` blocks ``[out, row_bytes]`` in the kernel's layout (``layout``)."""
    return layout(*unpack(blocks, kind), kind)


def layout(u: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, kind: str) -> Packed:
    """A weight as ``unpack`` reads it in the kernel's layout: per tile of 16 rows and block of 32
    inputs, the scales then the offsets of each scale group (16 each: fp16 where every one is
    exactly an fp16, else fp32), then the integers, 64 bytes per 4 inputs of the 16 rows (4-bit:
    inputs 0..15 of the block in the low nibbles, 16..31 in the high)."""
    rows, k = u.shape
    groups, bits = QK // GROUP[kind], BITS[kind]
    tiles = -(-rows // TILE)
    pad = tiles * TILE - rows
    u, scale, offset = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (u, scale, offset))
    u = u.view(tiles, TILE, k // QK, QK)
    if bits == 4:
        low, high = (part.reshape(tiles, TILE, -1, 4, 4).permute(0, 2, 3, 1, 4) for part in u.split(16, -1))
        weights = (low | high << 4).reshape(tiles, k // QK, -1)
    else:
        weights = u.reshape(tiles, TILE, -1, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, k // QK, -1)
    wide = not (exact_in_half(scale) and exact_in_half(offset))
    header = torch.stack([scale, offset], 1).view(tiles, TILE, 2, k // QK, groups)
    header = header.permute(0, 3, 2, 4, 1).to(torch.float32 if wide else torch.float16).contiguous()
    header = header.view(torch.uint8).view(tiles, k // QK, -1)
    data = torch.cat([header, weights], -1).reshape(-1).contiguous()
    return Packed(data, bits, groups, wide, rows, k)


def unlayout(weight: Packed, start: int = 0, stop: int | None = None) -> Unpacked:
    """Rows ``start:stop`` of a weight in the kernel's layout as ``unpack`` reads them: the same
    integers, scales and offsets ``layout`` was given (its inverse)."""
    stop = weight.out_features if stop is None else stop
    first, last = start // TILE, -(-stop // TILE)
    blocks, groups = weight.in_features // QK, weight.groups
    header_bytes = 2 * groups * TILE * (4 if weight.wide else 2)
    data = weight.data.view(-1, blocks, header_bytes + TILE * QK * weight.bits // 8)[first:last]
    tiles = last - first
    header = data[..., :header_bytes].contiguous().view(torch.float32 if weight.wide else torch.float16)
    header = header.view(tiles, blocks, 2, groups, TILE).permute(0, 4, 2, 1, 3).float()
    header = header.reshape(tiles * TILE, 2, blocks * groups)
    if weight.bits == 4:
        packed = data[..., header_bytes:].reshape(tiles, blocks, 4, TILE, 4).permute(0, 3, 1, 2, 4)
        halves = (packed & 0x0F, packed >> 4)
        u = torch.cat([h.reshape(tiles, TILE, blocks, 16) for h in halves], -1)
    else:
        u = data[..., header_bytes:].reshape(tiles, blocks, 8, TILE, 4).permute(0, 3, 1, 2, 4)
    rows = slice(start - first * TILE, stop - first * TILE)
    u = u.reshape(tiles * TILE, weight.in_features)[rows]
    return u.contiguous(), header[rows, 0].contiguous(), header[rows, 1].contiguous()


def matmul(
    weight: Packed,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    norm: tuple[torch.Tensor, float] | None = None,
    gated: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` for ``W`` repacked, x ``[..., in]`` in bf16 (kept) or another float
    dtype (taken, and returned, in fp32). ``norm`` (weight, epsilon) multiplies ``RMSNorm(x)``
    instead, ``gated`` takes x as ``[..., 2 * in]`` (gate, then up) and multiplies
    ``silu(gate) * up``, ``residual`` (the output's shape) is added: in fp32 inside, each row
    from itself alone."""
    lib = library()
    if lib is None:
        raise RuntimeError("the quantized kernels are not available: check usable() first")
    return product(lib, weight, x, bias, norm, gated, residual)


def product(
    lib: ctypes.CDLL,
    weight: Packed,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    norm: tuple[torch.Tensor, float] | None = None,
    gated: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``matmul`` on the library ``lib``."""
    dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    rows = x.reshape(-1, x.shape[-1]).to(dtype).contiguous()
    y = torch.empty(rows.shape[0], weight.out_features, dtype=dtype)
    if residual is not None:
        residual = residual.reshape(y.shape).to(dtype).contiguous()
    scale = None if norm is None else norm[0].to(dtype).contiguous()
    bias = None if bias is None else bias.float().contiguous()
    status = lib.multiguess_quant_matmul(
        ctypes.byref(QuantWeight.of(weight, bias)),
        rows.data_ptr(),
        y.data_ptr(),
        rows.shape[0],
        torch.get_num_threads(),
        int(dtype == torch.bfloat16),
        None if scale is None else scale.data_ptr(),
        0.0 if norm is None else norm[1],
        int(gated),
        None if residual is None else residual.data_ptr(),
    )
    if status != 0:
        raise MemoryError("quantized kernel: no memory for the prepared inputs")
    return y.view(*x.shape[:-1], weight.out_features)


@functools.cache
def bf16_entries() -> tuple[int, int]:
    """The addresses of the bf16 library's rotary-with-cache-write and attention kernels."""
    bf16 = bf16_kernel.loaded()
    functions = (bf16.multiguess_bf16_rope_cache, bf16.multiguess_attention)
    return tuple(ctypes.cast(f, ctypes.c_void_p).value for f in functions)  # type: ignore[return-value]


def run_layer(layer: QuantLayer, step: ctypes.Structure, x: torch.Tensor) -> None:
    """One decoder layer on the contiguous bf16 residual stream ``x`` ``[B, T, D]``, in place
    (``multiguess_quant_layer``): the products here, rotary with the cache write and attention
    from the bf16 library (``bf16_kernel.StepPlaces`` is ``step``), one call from Python."""
    lib = library()
    if lib is None:
        raise RuntimeError("the quantized kernels are not available: check usable() first")
    status = lib.multiguess_quant_layer(
        ctypes.byref(layer), ctypes.byref(step), x.data_ptr(), *bf16_entries()
    )
    if status != 0:
        raise MemoryError("quantized layer kernel: no memory for the prepared inputs")
