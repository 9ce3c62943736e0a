"""The CPU backend: repacked weights, whole layers in the bf16 kernels, fp32 attention.

CPU attention kernels are several times faster in fp32 than in bf16 for decode-sized queries,
and a small model's cache is small, so attention runs in fp32 over an fp32 cache whatever the
weights' dtype. On CPUs with AVX512-BF16 or AVX2 and bf16 weights each whole layer (norms,
products, SiLU gating, residual adds, rotary, cache write, attention) is one call into
multiguess's bf16 kernels (``bf16_kernel.py``), every row independent of the others, so a tree node's logits are
the bits of the same token decoded alone.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from multiguess.engine.backends import torch_layers
from multiguess.engine.backends.cpu import bf16_kernel, quant, quant_kernel
from multiguess.engine.backends.cpu.packed import PackedProjection, packing_supported, place_panels
from multiguess.engine.backends.cpu.quant import QuantizedProjection
from multiguess.engine.linear import Projection
from multiguess.engine.placement import Placement

if TYPE_CHECKING:
    from multiguess.engine.backends.cuda.graphs import StaticForward
    from multiguess.engine.backends.parts import ModelParts


def attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Attention of queries ``[B, T, H, D]`` over cached ``[B, KV, L, D]`` keys and values: ``[B, T, H*D]``.

    With several queries and grouped heads (KV < H), each key/value head's G = H/KV query heads
    are folded into its query length (``[B, KV, G*T, D]``, mask ``fold_mask``'s ``[B, 1, G*T, L]``):
    the kernel reads the cache once instead of repeating it G times, with the same result, and a
    tree's attention is compute-bound on CPUs. One query keeps the unfolded call: faster for it.
    """
    batch, width, heads, dim = q.shape
    groups = heads // keys.shape[1]
    if not folds(width, groups):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(batch, width, heads * dim)
    folded = (
        q.view(batch, width, -1, groups, dim).permute(0, 2, 3, 1, 4).reshape(batch, -1, groups * width, dim)
    )
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
    return out.view(batch, -1, groups, width, dim).permute(0, 3, 1, 2, 4).reshape(batch, width, heads * dim)


def folds(width: int, groups: int) -> bool:
    """Whether ``attention`` folds grouped query heads for ``width`` queries (and ``fold_mask``
    must repeat the mask): several queries and more query heads than key/value heads."""
    return width > 1 and groups > 1


def fold_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, 1, T, L]`` repeated for ``attention``'s folded queries: ``[B, 1, G*T, L]`` (once per forward)."""
    if not folds(mask.shape[2], groups):
        return mask
    batch, _, width, length = mask.shape
    return mask[:, :, None].expand(batch, 1, groups, width, length).reshape(batch, 1, groups * width, length)


def bf16_layers(runner: ModelParts) -> bool:
    """Whether every layer runs in the bf16 layer kernel: pre-norm SiLU-gated layers with bf16
    norms and packed panels, without q/k norms, of a head width the attention kernel holds."""
    return (
        runner.silu_gated
        and all(
            isinstance(p, PackedProjection) and p.panels is not None
            for p in (*runner.qkv, *runner.o, *runner.gate_up, *runner.down)
        )
        and all(
            norm.weight.dtype == torch.bfloat16
            for la in runner.layers
            for norm in (la.input_layernorm, la.post_attention_layernorm)
        )
        and not hasattr(runner.layers[0].self_attn, "q_norm")
        and bf16_kernel.attention_supported(runner.head_dim)
    )


class CpuBackend:
    name = "cpu"
    attn_dtype = torch.float32
    cost_tokens = 0  # the policy's own token budget bounds the curve
    attends_unmasked = False  # the kernels take one mask layout, and masking costs them little
    pages_kv = False  # the layer kernels read and write the static slot layout
    batched_acceptance = False  # rows processed only along the accepted path, by the C kernels

    def __init__(self, dtype: torch.dtype, eager: bool) -> None:
        self.packed = not eager and packing_supported(dtype)
        # Quantized layers (GGUF blocks) on the integer kernels, the others repacked.
        self.projection: type[Projection] = QuantizedProjection if self.packed else Projection
        self.layer_weights: list[bf16_kernel.LayerWeights] = []
        self.quantized_layers = False  # GGUF-quantized layers with per-row attention (quant.py)

    def kv_dtype(self, runner: ModelParts) -> torch.dtype:
        """bf16 where every layer runs in the bf16 or the quantized layer kernel: each key and
        value they write is a bf16 value (rotary rounds to bf16), so the cache holds it exactly in
        half the bytes and attention reads half as many; fp32 where torch attends over it."""
        return torch.bfloat16 if any(self._kernel_layers(runner)) else torch.float32

    def _kernel_layers(self, runner: ModelParts) -> tuple[bool, bool]:
        """Whether every layer runs in the bf16 layer kernel (``bf16_layers``), and whether in the
        quantized one: the one choice both the cache's dtype and ``attach`` follow."""
        return bf16_layers(runner), self.packed and quant.layers_supported(runner)

    def attach(self, runner: ModelParts) -> None:
        """Panels onto huge pages; whole layers in the bf16 kernels where every part of a layer
        has them (``bf16_layers``), else in the quantized layer kernel where it applies."""
        projections = [*runner.qkv, *runner.o, *runner.gate_up, *runner.down, runner.head]
        place_panels(projections)
        bf16, self.quantized_layers = self._kernel_layers(runner)
        self.layer_weights = (
            [self._layer_weights(runner, i) for i in range(len(runner.layers))] if bf16 else []
        )
        self.quant_layers = (
            [quant.layer_weights(runner, i) for i in range(len(runner.layers))]
            if self.quantized_layers
            else []
        )

    @property
    def layer_kernels(self) -> bool:
        return bool(self.layer_weights)

    @property
    def ragged_rows(self) -> bool:
        """The layer kernels compute every row alone, over the keys its mask shows it."""
        return self.layer_kernels or self.quantized_layers

    @property
    def label(self) -> str:
        if self.layer_kernels:
            return "multiguess bf16 on AMX tiles" if bf16_kernel.matrix_units() else "multiguess bf16"
        if self.quantized_layers:
            return "multiguess quantized"
        return "prepacked" if self.packed else "eager"

    def mask(self, visible: torch.Tensor, plain: bool) -> torch.Tensor:
        """Additive, once per forward: a bool mask is converted by the kernel in every layer."""
        mask = torch.zeros(visible.shape, dtype=self.attn_dtype, device=visible.device)
        return mask.masked_fill_(~visible, float("-inf"))

    def static_forward(self, runner: ModelParts, max_width: int) -> StaticForward:
        raise ValueError("CUDA graphs run on the torch backend (GPUs); this runner uses the CPU's")

    def run_layers(self, runner: ModelParts, x: torch.Tensor, at: Placement) -> torch.Tensor:
        if self.layer_kernels:
            return self._layers_in_kernels(runner, x, at, bf16_kernel.run_layer, self.layer_weights)
        if self.quantized_layers:
            return self._layers_in_kernels(runner, x, at, quant_kernel.run_layer, self.quant_layers)
        at = at._replace(mask=fold_mask(at.mask, runner.num_heads // runner.num_kv_heads))
        return torch_layers.run_layers(runner, x, at, attention)

    @staticmethod
    def _layer_weights(runner: ModelParts, i: int) -> bf16_kernel.LayerWeights:
        """Layer i's packed weights, norms and cache, as the layer kernel reads them."""
        layer = runner.layers[i]
        qkv, o, gate_up, down = runner.qkv[i], runner.o[i], runner.gate_up[i], runner.down[i]
        pointer = bf16_kernel.pointer
        return bf16_kernel.LayerWeights(
            input_norm=layer.input_layernorm.weight.data_ptr(),
            post_norm=layer.post_attention_layernorm.weight.data_ptr(),
            qkv=qkv.panels.data_ptr(),
            qkv_bias=pointer(qkv.bias),
            o=o.panels.data_ptr(),
            o_bias=pointer(o.bias),
            gate_up=gate_up.panels.data_ptr(),
            gate_up_bias=pointer(gate_up.bias),
            down=down.panels.data_ptr(),
            down_bias=pointer(down.bias),
            cache=runner.cache.kv[i].data_ptr(),
            qkv_n=qkv.weight.shape[0],
            inter=down.weight.shape[1],
            eps=layer.input_layernorm.variance_epsilon,
            post_eps=layer.post_attention_layernorm.variance_epsilon,
            scale=runner.attention_scale(i),
        )

    @staticmethod
    def _layers_in_kernels(
        runner: ModelParts,
        x: torch.Tensor,
        at: Placement,
        run: Callable[[Any, bf16_kernel.StepPlaces, torch.Tensor], None],
        layers: Sequence[ctypes.Structure],
    ) -> torch.Tensor:
        """Every layer on bf16 ``x`` ``[B, T, D]`` (updated in place), one kernel call each
        (``run``: the bf16 or the quantized layer kernel, over ``layers``); the kernels take
        ``[B, T, D]`` rotary tables, a ``[B, T, L]`` mask and slot/start tensors."""
        x = x.contiguous()
        batch, width, d = x.shape
        rows, inner = batch * width, runner.num_heads * runner.head_dim
        bf16 = torch.bfloat16
        qkv = torch.empty(rows, sum(runner.qkv[0].sizes), dtype=bf16)
        attn, h = torch.empty(rows, inner, dtype=bf16), torch.empty(rows, d, dtype=bf16)
        gate_up = torch.empty(rows, sum(runner.gate_up[0].sizes), dtype=bf16)
        queries = torch.empty(rows, inner, dtype=torch.float32)
        cos, sin = (table[:, :, 0].contiguous() for table in at.rope)
        starts, mask = at.write_from.to(torch.int64).contiguous(), at.mask[:, 0].contiguous()
        slot_ids = torch.tensor(at.slots)
        step = bf16_kernel.StepPlaces(
            *(t.data_ptr() for t in (cos, sin, slot_ids, starts, mask, qkv, attn, gate_up, h, queries)),
            batch=batch,
            width=width,
            d=d,
            heads=runner.num_heads,
            kv_heads=runner.num_kv_heads,
            dim=runner.head_dim,
            capacity=runner.capacity,
            length=at.length,
            threads=torch.get_num_threads(),
            amx=int(bf16_kernel.matrix_units()),
        )
        for i, layer in enumerate(layers):
            if at.captured is not None and i in at.captured:
                at.captured[i] = x.clone()  # the kernel updates x in place
            run(layer, step, x)
        return x
