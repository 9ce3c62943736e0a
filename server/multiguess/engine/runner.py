"""The native forward pass: a transformers model's own weights, driven over a static KV cache.

transformers' generic forward spends most of a CPU decode step in framework overhead and has
no notion of writing a token tree into a pre-allocated cache. The supported families share
one layer layout, so this module calls the model's submodules (norms, projections, rotary
embedding, MLP) directly and does the attention itself: a batch of token trees, each placed
after its sequence's prefix, attends to prefix + its own ancestors in one forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from multiguess.engine.kv_cache import StaticKVCache
from multiguess.engine.tree import TokenTree, pack_trees
from multiguess.models.loading import LoadedModel


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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


@dataclass
class FusedProjection:
    """Several Linear layers reading the same input, run as one matmul.

    The fused weight is one tensor; each original layer's weight is re-pointed to a view of it,
    so the model keeps working as a transformers module and no memory is duplicated.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: list[int]

    @classmethod
    def of(cls, linears: list[torch.nn.Module]) -> FusedProjection | None:
        if not all(type(m) is torch.nn.Linear for m in linears):
            return None  # e.g. dynamically quantized layers: keep them as they are
        with torch.no_grad():
            weight = torch.cat([m.weight for m in linears])
            has_bias = [m.bias is not None for m in linears]
            bias = None
            if any(has_bias):
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
        return cls(weight, bias, [m.out_features for m in linears])

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


class NativeRunner:
    """Runs one model over its own static KV cache (one slot per sequence).

    On CPUs attention runs in float32 over a float32 cache whatever the weights' dtype: the
    CPU kernels are several times faster in fp32 than in bf16 for decode-sized queries, and
    the cache of a small model is small. q/k/v and gate/up projections run fused.
    """

    def __init__(self, loaded: LoadedModel, num_slots: int, capacity: int) -> None:
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
        self.qkv = [
            FusedProjection.of([la.self_attn.q_proj, la.self_attn.k_proj, la.self_attn.v_proj])
            for la in self.layers
        ]
        self.gate_up = [FusedProjection.of([la.mlp.gate_proj, la.mlp.up_proj]) for la in self.layers]

    @torch.inference_mode()
    def forward(
        self,
        slots: list[int],
        prefix_lens: list[int],
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write_at: torch.Tensor,
        visible: torch.Tensor,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write a batch of token-tree nodes into the caches and return float32 logits.

        ``tokens``, ``positions`` (rotary) and ``write_at`` (absolute cache index) are ``[B, T]``;
        ``visible`` is ``[B, T, W]`` over the region after each prefix (see
        ``region_attention_mask``). Logits are for every node ``[B, T, V]``, or for the
        ``logits_at`` column of each row only ``[B, V]`` (a prefill needs just the last one).
        """
        batch, width = tokens.shape
        device = self.device
        write_at = write_at.to(device)
        length = max(int(write_at.max()) + 1, max(prefix_lens) + visible.shape[2])
        if length > self.capacity:
            raise ValueError(f"sequence would exceed the cache capacity of {self.capacity} tokens")
        mask = region_attention_mask(torch.tensor(prefix_lens, device=device), visible.to(device), length)
        slot_index = torch.tensor(slots, device=device)
        selector = StaticKVCache.selector(slots)

        x = self.embed(tokens.to(device)).to(self.dtype)
        cos, sin = self.rotary(x, positions.to(device))
        cos, sin = cos[:, None], sin[:, None]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            if self.qkv[i] is not None:
                q, k, v = self.qkv[i](h)
            else:
                q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
            q = q.view(batch, width, -1, self.head_dim)
            k = k.view(batch, width, -1, self.head_dim)
            v = v.view(batch, width, -1, self.head_dim).transpose(1, 2)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            self.cache.write(i, slot_index, write_at, k.to(self.attn_dtype), v.to(self.attn_dtype))
            keys, values = self.cache.read(i, selector, length)
            out = F.scaled_dot_product_attention(
                q.to(self.attn_dtype),
                keys,
                values,
                attn_mask=mask,
                scale=getattr(attn, "scaling", None),
                enable_gqa=True,
            ).to(self.dtype)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, width, -1))
            x = x + self._mlp(i, layer.mlp, layer.post_attention_layernorm(x))
        x = self.norm(x)
        if logits_at is not None:
            x = x[torch.arange(batch, device=device), logits_at.to(device)]
        return self.lm_head(x).float()

    def _mlp(self, i: int, mlp: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        if self.gate_up[i] is None:
            return mlp(h)
        gate, up = self.gate_up[i](h)
        return mlp.down_proj(mlp.act_fn(gate) * up)

    def forward_trees(
        self, slots: list[int], prefix_lens: list[int], trees: list[TokenTree], last_only: bool = False
    ) -> torch.Tensor:
        """Each tree written right after its prefix, seeing prefix + ancestors (verify, prefill)."""
        tokens, depths, ancestors = pack_trees(trees)
        lens = torch.tensor(prefix_lens)
        offsets = torch.arange(tokens.shape[1])
        logits_at = torch.tensor([len(t) - 1 for t in trees]) if last_only else None
        return self.forward(
            slots, prefix_lens, tokens, lens[:, None] + depths, lens[:, None] + offsets, ancestors, logits_at
        )
