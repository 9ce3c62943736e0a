"""The native forward pass: a transformers model's own weights, driven over a static KV cache.

transformers' generic forward spends most of a CPU decode step in framework overhead and has
no notion of writing a token tree into a pre-allocated cache. The supported families share
one layer layout, so this module drives the model's own weights and submodules (rotary
embedding, activation) directly, runs RMSNorm as one fused call with each norm's weight and
epsilon, and does the attention itself: a batch of token trees, each placed after its
sequence's prefix, attends to prefix + its own ancestors in one forward. On CPUs with
AVX512-BF16 and bf16 weights each whole layer (norms, products, SiLU gating, residual adds,
rotary, cache write, attention) is one call into multiguess's bf16 kernels (``bf16_kernel.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from multiguess.engine import bf16_kernel
from multiguess.engine.kv_cache import StaticKVCache
from multiguess.engine.linear import Projection, packing_supported, place_panels, rms_norm
from multiguess.engine.tree import TokenTree, pack_trees
from multiguess.models.loading import LoadedModel


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and a sign-folded ``sin`` for ``apply_rotary``, broadcast over heads of [B, T, H, D]."""
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos[:, :, None], signed[:, :, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin``, bitwise (``(-a) * s == a * (-s)``), with
    the negation folded into the table once per forward instead of once per layer."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


def region_attention_mask(prefix_lens: torch.Tensor, visible: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, 1, T, length]`` bool attention mask over a cache of ``length`` positions.

    Sequence b's committed prefix is cache ``[0, prefix_lens[b])``; after it lies a *region*
    of tree nodes (this forward's and, for a drafter growing a tree level by level, earlier
    levels'). Input row i sees the whole prefix and region column j where ``visible[b, i, j]``.
    """
    batch, width, region = visible.shape
    rel = torch.arange(length, device=prefix_lens.device)[None, :] - prefix_lens[:, None]
    in_region = (rel >= 0) & (rel < region)
    cols = rel.clamp(0, region - 1)[:, None, :].expand(batch, width, length)
    return ((rel < 0)[:, None, :] | (visible.gather(2, cols) & in_region[:, None, :]))[:, None]


def attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Attention of queries ``[B, T, H, D]`` over cached ``[B, KV, L, D]`` keys and values: ``[B, T, H*D]``.

    With several queries and grouped heads (KV < H), each key/value head's G = H/KV query heads
    are folded into its query length (``[B, KV, G*T, D]``, mask ``fold_mask``'s ``[B, 1, G*T, L]``):
    the kernel reads the cache once instead of repeating it G times. The same result (bitwise,
    on the CPU kernels measured here); the attention 1.3-1.6x faster and a whole verification
    forward 4-24% (4-16 trees of 2-5 nodes at 250-600 tokens of context), since a tree's
    attention is compute-bound on CPUs. One query keeps the unfolded call: faster for it.
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


class Placement(NamedTuple):
    """Where one forward's tokens go: rotary tables ``[B, T, 1, D]``, the sequences' slots, the
    cache row each starts writing at, the additive mask ``[B, 1, T, L]`` and its length L."""

    rope: tuple[torch.Tensor, torch.Tensor]
    slots: list[int]
    write_from: torch.Tensor
    mask: torch.Tensor
    length: int


class NativeRunner:
    """Runs one model over its own static KV cache (one slot per sequence).

    On CPUs attention runs in float32 over a float32 cache whatever the weights' dtype: the
    CPU kernels are several times faster in fp32 than in bf16 for decode-sized queries, and
    the cache of a small model is small. q/k/v and gate/up projections run fused, and on CPUs
    every projection uses prepacked weights (``engine/linear.py``) unless ``eager``.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        num_slots: int,
        capacity: int,
        eager: bool = False,
        head_vocab: torch.Tensor | None = None,
    ) -> None:
        model = loaded.model
        config = model.config
        self.model = model
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.vocab_size = config.vocab_size
        self.layers = list(model.model.layers)
        self.embed = model.model.embed_tokens
        self.norm = model.model.norm
        self.rotary = model.model.rotary_emb
        self.lm_head = model.lm_head
        self.silu_gated = getattr(config, "hidden_act", None) in ("silu", "swish")
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.capacity = capacity
        self.attn_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        self.cache = StaticKVCache(
            len(self.layers),
            num_slots,
            self.num_kv_heads,
            capacity,
            self.head_dim,
            self.attn_dtype,
            self.device,
        )
        pack = not eager and packing_supported(self.device, self.dtype)
        self.packed = pack
        self.qkv = [
            Projection.of([la.self_attn.q_proj, la.self_attn.k_proj, la.self_attn.v_proj], pack)
            for la in self.layers
        ]
        self.o = [Projection.of([la.self_attn.o_proj], pack) for la in self.layers]
        self.gate_up = [Projection.of([la.mlp.gate_proj, la.mlp.up_proj], pack) for la in self.layers]
        self.down = [Projection.of([la.mlp.down_proj], pack) for la in self.layers]
        self.head = Projection.of([self.lm_head], pack)
        # Scoring only ``head_vocab`` (a draft's vocabulary, models/draft_vocab.py): logit column
        # j is token head_vocab[j]. Needs a plain Linear head: a quantized one scores every token.
        self.head_vocab = None
        if head_vocab is not None and (subset := Projection.rows(self.lm_head, head_vocab, pack)):
            self.head, self.head_vocab = subset, head_vocab.to(self.device)
        place_panels([*self.qkv, *self.o, *self.gate_up, *self.down, self.head])
        # Whole layers in the bf16 kernels (bf16_kernel.py): norms, products, rotary, cache write,
        # attention and residual adds in one call per layer, attention rows independent of the
        # batch's shape. Pre-norm SiLU-gated layers with bf16 norms, without q/k norms.
        self.layer_kernels = (
            self.attn_dtype == torch.float32
            and self.silu_gated
            and all(
                p is not None and p.panels is not None
                for p in (*self.qkv, *self.o, *self.gate_up, *self.down)
            )
            and all(
                norm.weight.dtype == torch.bfloat16
                for la in self.layers
                for norm in (la.input_layernorm, la.post_attention_layernorm)
            )
            and not hasattr(self.layers[0].self_attn, "q_norm")
            and bf16_kernel.attention_supported(self.head_dim)
        )
        self.layer_weights = (
            [self._layer_weights(i) for i in range(len(self.layers))] if self.layer_kernels else []
        )

    @torch.inference_mode()
    def forward(
        self,
        slots: list[int],
        prefix_lens: list[int],
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write_from: torch.Tensor,
        visible: torch.Tensor,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write a batch of token-tree nodes into the caches and return float32 logits.

        ``tokens`` and ``positions`` (rotary) are ``[B, T]``; row b is written to the cache at
        ``write_from[b] + 0..T-1``; ``visible`` is ``[B, T, W]`` over the region after each
        prefix (see ``region_attention_mask``). Logits are for every node ``[B, T, V]``, or for the
        ``logits_at`` column of each row only ``[B, V]`` (a prefill needs just the last one); V
        is the vocabulary, or ``head_vocab`` when the runner scores only that.
        """
        batch, width = tokens.shape
        device = self.device
        length = max(int(write_from.max()) + width, max(prefix_lens) + visible.shape[2])
        if length > self.capacity:
            raise ValueError(f"sequence would exceed the cache capacity of {self.capacity} tokens")
        visible_mask = region_attention_mask(
            torch.tensor(prefix_lens, device=device), visible.to(device), length
        )
        # Additive form once per forward: a bool mask is converted by the kernel in every layer.
        mask = torch.zeros(visible_mask.shape, dtype=self.attn_dtype, device=device)
        mask.masked_fill_(~visible_mask, float("-inf"))
        x = self.embed(tokens.to(device)).to(self.dtype)
        cos, sin = self.rotary(x, positions.to(device))
        rope = rotary_tables(cos, sin)
        at = Placement(rope, slots, write_from, mask, length)
        x = self._layers_in_kernels(x, at) if self.layer_kernels else self._layers_in_torch(x, at)
        if logits_at is not None:  # the norm is per row: selecting first is the same
            x = x[torch.arange(batch, device=device), logits_at.to(device)]
        if self.head is None:
            return self.lm_head(rms_norm(self.norm, x)).float()
        return self.head(x, norm=self.norm).float()

    def _scale(self, i: int) -> float:
        return getattr(self.layers[i].self_attn, "scaling", None) or self.head_dim**-0.5

    def _layer_weights(self, i: int) -> bf16_kernel.LayerWeights:
        """Layer i's packed weights, norms and cache, as the layer kernel reads them."""
        layer = self.layers[i]
        qkv, o, gate_up, down = self.qkv[i], self.o[i], self.gate_up[i], self.down[i]
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
            cache=self.cache.kv[i].data_ptr(),
            qkv_n=qkv.weight.shape[0],
            inter=down.weight.shape[1],
            eps=layer.input_layernorm.variance_epsilon,
            post_eps=layer.post_attention_layernorm.variance_epsilon,
            scale=self._scale(i),
        )

    def _layers_in_kernels(self, x: torch.Tensor, at: Placement) -> torch.Tensor:
        """Every layer on bf16 ``x`` ``[B, T, D]`` (updated in place), one kernel call each; the
        kernels take ``[B, T, D]`` rotary tables, a ``[B, T, L]`` mask and slot/start tensors."""
        x = x.contiguous()
        batch, width, d = x.shape
        rows, inner = batch * width, self.num_heads * self.head_dim
        bf16 = torch.bfloat16
        qkv = torch.empty(rows, self.qkv[0].weight.shape[0], dtype=bf16)
        attn, h = torch.empty(rows, inner, dtype=bf16), torch.empty(rows, d, dtype=bf16)
        gate_up = torch.empty(rows, self.gate_up[0].weight.shape[0], dtype=bf16)
        queries = torch.empty(rows, inner, dtype=torch.float32)
        cos, sin = (table[:, :, 0].contiguous() for table in at.rope)
        starts, mask = at.write_from.to(torch.int64).contiguous(), at.mask[:, 0].contiguous()
        slot_ids = torch.tensor(at.slots)
        step = bf16_kernel.StepPlaces(
            *(t.data_ptr() for t in (cos, sin, slot_ids, starts, mask, qkv, attn, gate_up, h, queries)),
            batch=batch,
            width=width,
            d=d,
            heads=self.num_heads,
            kv_heads=self.num_kv_heads,
            dim=self.head_dim,
            capacity=self.capacity,
            length=at.length,
            threads=torch.get_num_threads(),
        )
        for layer in self.layer_weights:
            bf16_kernel.run_layer(layer, step, x)
        return x

    def _layers_in_torch(self, x: torch.Tensor, at: Placement) -> torch.Tensor:
        """Every layer through torch ops and the projections, on ``x`` ``[B, T, D]``."""
        mask = fold_mask(at.mask, self.num_heads // self.num_kv_heads)
        where = self.cache.locate(at.slots, at.write_from, x.shape[1])
        selector = StaticKVCache.selector(at.slots)
        for i, layer in enumerate(self.layers):
            q = self._queries_writing_cache(i, x, at.rope, where)
            keys, values = self.cache.read(i, selector, at.length)
            out = attention(q, keys, values, mask, self._scale(i)).to(self.dtype)
            x = x + layer.self_attn.o_proj(out) if self.o[i] is None else self.o[i](out, residual=x)
            x = self._mlp(i, x)
        return x

    def _queries_writing_cache(
        self, i: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], where: tuple
    ) -> torch.Tensor:
        """Layer i's rotated queries ``[B, T, heads, D]``; its keys and values go to the cache."""
        heads = self.num_heads
        qkv = self._rotated_qkv(i, x, rope)
        self.cache.write(i, where, qkv[:, :, heads:].transpose(1, 2))
        return qkv[:, :, :heads]

    def _rotated_qkv(self, i: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Queries, keys and values of the normed ``x`` ``[B, T, heads + 2 * kv_heads, D]`` in the
        attention dtype, rotary applied to queries and keys together (the same math, half the ops)."""
        attn = self.layers[i].self_attn
        batch, width = x.shape[:2]
        if self.qkv[i] is not None:
            qkv = self.qkv[i](x, norm=self.layers[i].input_layernorm).view(batch, width, -1, self.head_dim)
        else:
            h = rms_norm(self.layers[i].input_layernorm, x)
            qkv = torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], -1).view(
                batch, width, -1, self.head_dim
            )
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if hasattr(attn, "q_norm"):
            q, k = qkv[:, :, :heads], qkv[:, :, heads : heads + kv_heads]
            qk = torch.cat([rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)], 2)
        else:
            qk = qkv[:, :, : heads + kv_heads]
        qk = apply_rotary(qk, *rope)
        return torch.cat([qk, qkv[:, :, heads + kv_heads :]], 2).to(self.attn_dtype)

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus the MLP of its normed self; SiLU-gated ones as two projection calls."""
        layer = self.layers[i]
        mlp, norm = layer.mlp, layer.post_attention_layernorm
        gate_up, down = self.gate_up[i], self.down[i]
        if gate_up is None or down is None:
            return x + mlp(rms_norm(norm, x))
        if self.silu_gated:
            return down(gate_up(x, norm=norm), gated=True, residual=x)
        gate, up = gate_up.split(rms_norm(norm, x))
        return down(mlp.act_fn(gate) * up, residual=x)

    def forward_trees(
        self, slots: list[int], prefix_lens: list[int], trees: list[TokenTree], last_only: bool = False
    ) -> torch.Tensor:
        """Each tree written right after its prefix, seeing prefix + ancestors (verify, prefill)."""
        tokens, depths, ancestors = pack_trees(trees)
        lens = torch.tensor(prefix_lens)
        logits_at = torch.tensor([len(t) - 1 for t in trees]) if last_only else None
        return self.forward(slots, prefix_lens, tokens, lens[:, None] + depths, lens, ancestors, logits_at)
