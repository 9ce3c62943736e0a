"""The decoder layers as torch ops over the runner's projections and cache, for any device.

Backends pass their own attention: ``attend(q, keys, values, mask, scale)`` with queries
``[B, T, H, D]`` and cached keys and values ``[B, KV, L, D]``, returning ``[B, T, H * D]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from multiguess.engine.linear import rms_norm
from multiguess.engine.placement import Placement, apply_rotary

if TYPE_CHECKING:
    from multiguess.engine.backends.parts import ModelParts

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float], torch.Tensor]


def run_layers(runner: ModelParts, x: torch.Tensor, at: Placement, attend: Attend) -> torch.Tensor:
    """Every layer on ``x`` ``[B, T, D]``: projections, rotary, cache write, attention, MLP."""
    where = runner.cache.locate(at.slots, at.write_from, x.shape[1])
    reader = runner.cache.reader(at.slots, at.length)
    for i in range(len(runner.layers)):
        if at.captured is not None and i in at.captured:
            at.captured[i] = x.clone()
        q = queries_writing_cache(runner, i, x, at.rope, where)
        keys, values = runner.cache.read(i, reader, at.length)
        out = attend(q, keys, values, at.mask, runner.attention_scale(i)).to(runner.dtype)
        o = runner.o[i]
        x = x + runner.layers[i].self_attn.o_proj(out) if o is None else o(out, residual=x)
        x = mlp(runner, i, x)
    return x


def queries_writing_cache(
    runner: ModelParts, i: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], where: tuple
) -> torch.Tensor:
    """Layer i's rotated queries ``[B, T, heads, D]``; its keys and values go to the cache."""
    heads = runner.num_heads
    qkv = rotated_qkv(runner, i, x, rope)
    runner.cache.write(i, where, qkv[:, :, heads:].transpose(1, 2))
    return qkv[:, :, :heads]


def rotated_qkv(
    runner: ModelParts, i: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Queries, keys and values of the normed ``x`` ``[B, T, heads + 2 * kv_heads, D]`` in the
    attention dtype, rotary applied to queries and keys together (the same math, half the ops)."""
    layer = runner.layers[i]
    attn = layer.self_attn
    batch, width = x.shape[:2]
    if runner.qkv[i] is not None:
        qkv = runner.qkv[i](x, norm=layer.input_layernorm).view(batch, width, -1, runner.head_dim)
    else:
        h = rms_norm(layer.input_layernorm, x)
        qkv = torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], -1).view(
            batch, width, -1, runner.head_dim
        )
    heads, kv_heads = runner.num_heads, runner.num_kv_heads
    if hasattr(attn, "q_norm"):
        q, k = qkv[:, :, :heads], qkv[:, :, heads : heads + kv_heads]
        qk = torch.cat([rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)], 2)
    else:
        qk = qkv[:, :, : heads + kv_heads]
    qk = apply_rotary(qk, *rope)
    return torch.cat([qk, qkv[:, :, heads + kv_heads :]], 2).to(runner.attn_dtype)


def mlp(runner: ModelParts, i: int, x: torch.Tensor) -> torch.Tensor:
    """``x`` plus the MLP of its normed self; SiLU-gated ones as two projection calls."""
    layer = runner.layers[i]
    module, norm = layer.mlp, layer.post_attention_layernorm
    gate_up, down = runner.gate_up[i], runner.down[i]
    if gate_up is None or down is None:
        return x + module(rms_norm(norm, x))
    if runner.silu_gated:
        return down(gate_up(x, norm=norm), gated=True, residual=x)
    gate, up = gate_up.split(rms_norm(norm, x))
    return down(module.act_fn(gate) * up, residual=x)
