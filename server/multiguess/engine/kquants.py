"""Q4_K and Q6_K blocks written from float weights (the ``gguf`` package reads them but has no
writer for them).

Both formats group 256 weights into a super-block with an fp16 scale that scales small integer
scales per sub-block: Q4_K has 8 sub-blocks of 32 with 6-bit scales and 6-bit minimums
(weight = d * sc * u - dmin * m, u 4 bits), Q6_K 16 sub-blocks of 16 with int8 scales
(weight = d * sc * (u - 32), u 6 bits). The rounding here is plain (each sub-block's range
mapped onto its integers), not llama.cpp's search for the scales that minimise the error, so a
file llama.cpp quantizes is somewhat closer to its original than the same format written here;
the blocks are laid out exactly as ggml lays them out.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def to_half(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def scaled(values: np.ndarray, scale: np.ndarray, top: int) -> np.ndarray:
    """round(values / scale) clipped to [0, top] (0 where the scale is 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale > 0, np.rint(values / scale), 0)
    return np.clip(q, 0, top)


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """``[n, k]`` fp32 (k a multiple of 256) as rows of Q4_K blocks ``[n, k / 256 * 144]``."""
    rows = weight.shape[0]
    x = weight.reshape(-1, 8, 32).astype(np.float32)
    low = np.minimum(x.min(-1), 0.0)
    sub_scale, sub_min = (x.max(-1) - low) / 15, -low
    d, dmin = to_half(sub_scale.max(-1) / 63), to_half(sub_min.max(-1) / 63)
    sc = scaled(sub_scale, d.astype(np.float32)[:, None], 63).astype(np.uint8)
    sc = np.where((sc == 0) & (sub_scale > 0), 1, sc).astype(np.uint8)
    m = scaled(sub_min, dmin.astype(np.float32)[:, None], 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    u = scaled(x + offset[..., None], step[..., None], 15).astype(np.uint8)
    scales = np.concatenate(
        [
            (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
            (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4),
        ],
        axis=-1,
    ).astype(np.uint8)
    pairs = u.reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    halves = np.stack([d, dmin], -1).view(np.uint8).reshape(-1, 4)
    return np.concatenate([halves, scales, qs], axis=-1).reshape(rows, -1)


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """``[n, k]`` fp32 (k a multiple of 256) as rows of Q6_K blocks ``[n, k / 256 * 210]``."""
    rows = weight.shape[0]
    x = weight.reshape(-1, 16, 16).astype(np.float32)
    sub_scale = np.abs(x).max(-1) / 31
    d = to_half(sub_scale.max(-1) / 127)
    sc = scaled(sub_scale, d.astype(np.float32)[:, None], 127).astype(np.int8)
    sc = np.where((sc == 0) & (sub_scale > 0), 1, sc).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint(x / step[..., None]), 0)
    u = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    low, high = u & 0x0F, u >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)
    parts = high.reshape(-1, 2, 4, 32)
    qh = (parts[:, :, 0] | (parts[:, :, 1] << 2) | (parts[:, :, 2] << 4) | (parts[:, :, 3] << 6)).reshape(
        -1, 64
    )
    return np.concatenate([ql, qh, sc.view(np.uint8), d.reshape(-1, 1).view(np.uint8)], axis=-1).reshape(
        rows, -1
    )
