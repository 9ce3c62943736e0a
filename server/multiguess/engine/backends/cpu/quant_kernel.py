"""Integer products over GGUF block weights on CPUs, compiled from C on first use.

A decode step over quantized weights waits on memory: Q4_1 blocks are 0.625 bytes a weight
against bf16's 2, so streaming them as they are, instead of dequantized, reads 3.2x fewer
bytes. ``kernels/quant_kernels.c`` quantizes each row of the input to int8 blocks (as llama.cpp
does) and multiplies them with the weights' integers (AVX2 ``vpmaddubsw``/``vpmaddwd``, or a
portable loop on CPUs without AVX2), each row independently of the others, so a row's result
is the same bits in a one-token step and inside a verified tree. Built and cached like the bf16
kernels (``bf16_kernel.py``: ``Sources``), in the variants below; ``MULTIGUESS_QUANT_KERNEL=0``
switches it off (quantized linears then decode their weights on every call).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from multiguess.engine.backends.cpu.bf16_kernel import KERNELS, Sources, Variant, cpu_variant, open_library

QUANT = Sources(
    "quant_kernels",
    (KERNELS / "quant_kernels.c",),
    (),
    {  # best first
        "avx2": Variant(frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c")),
        "portable": Variant(frozenset(), ()),
    },
    "MULTIGUESS_QUANT_KERNEL",
)
CODES = {"q8_0": 0, "q4_0": 1, "q4_1": 2}  # quant_kernels.c's format numbers


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (and one log line saying why) where they cannot be used."""
    lib = open_library(
        QUANT,
        cpu_variant(QUANT),
        "quantized linears decode their weights on every call (slow)",
        "quantized kernels unavailable, decoding weights on every call",
    )
    if lib is None:
        return None
    lib.multiguess_quant_matmul.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,
        *[ctypes.c_void_p] * 3,
        *[ctypes.c_int64] * 3,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    lib.multiguess_quant_matmul.restype = ctypes.c_int
    return lib


def usable(kind: str) -> bool:
    """Whether the kernels run here and read this format."""
    return kind in CODES and library() is not None


def matmul(
    blocks: torch.Tensor,
    kind: str,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    norm: tuple[torch.Tensor, float] | None = None,
    gated: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` for ``W`` in ``kind`` blocks ``[out, row_bytes]``, x ``[..., in]`` in
    bf16 (kept) or another float dtype (taken, and returned, in fp32). ``norm`` (weight,
    epsilon) multiplies ``RMSNorm(x)`` instead, ``gated`` takes x as ``[..., 2 * in]`` (gate,
    then up) and multiplies ``silu(gate) * up``, ``residual`` (the output's shape) is added: in
    fp32 inside, each row from itself alone."""
    lib = library()
    if lib is None:
        raise RuntimeError("the quantized kernels are not available: check usable() first")
    dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    out_features = blocks.shape[0]
    rows = x.reshape(-1, x.shape[-1]).to(dtype).contiguous()
    in_features = rows.shape[1] // 2 if gated else rows.shape[1]
    y = torch.empty(rows.shape[0], out_features, dtype=dtype)
    if residual is not None:
        residual = residual.reshape(y.shape).to(dtype).contiguous()
    weight = None if norm is None else norm[0].to(dtype).contiguous()
    bias = None if bias is None else bias.float().contiguous()
    status = lib.multiguess_quant_matmul(
        blocks.data_ptr(),
        CODES[kind],
        rows.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        rows.shape[0],
        in_features,
        out_features,
        torch.get_num_threads(),
        int(dtype == torch.bfloat16),
        None if weight is None else weight.data_ptr(),
        0.0 if norm is None else norm[1],
        int(gated),
        None if residual is None else residual.data_ptr(),
    )
    if status != 0:
        raise MemoryError("quantized kernel: no memory for the prepared inputs")
    return y.view(*x.shape[:-1], out_features)
