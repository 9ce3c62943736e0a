"""The EAGLE-3 draft head: one decoder layer over the target's own hidden states.

The head predicts the token after next from two inputs per position: the embedding of the
next token and a feature of the target. For positions the target computed, the feature is
``fc`` of the target's hidden states entering a low, a middle and a high layer, concatenated
(``aux_layers``); for positions only the draft has seen (deeper tree levels), it is the head's
own output before its final norm. The layer's attention reads both halves (``2 * hidden`` wide
q/k/v inputs), its residual stream starts from the feature, and its logits cover a reduced
draft vocabulary that ``d2t`` maps back to the target's ids (``draft id + d2t[id]``).

The module names follow the ecosystem's ``LlamaForCausalLMEagle3`` checkpoints (SGLang, vLLM,
SpecForge), so published heads load with their own names (``models/eagle3_checkpoint.py``).
The same math serves drafting (``engine/eagle3.py``, over a KV cache) and training
(``distill/eagle3_train.py``, all positions at once): the attention is left to the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The layers whose *input* hidden states EAGLE-3 fuses, as SGLang and vLLM pick them: a low,
    the middle and a high one (``output_hidden_states[i]`` in transformers' numbering)."""
    return (min(2, num_layers - 1), num_layers // 2, max(0, num_layers - 3))


@dataclass(frozen=True)
class Eagle3Config:
    """A head's shape, the target it reads, and where its features come from."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    extra: dict = field(default_factory=dict, compare=False)  # other config keys, kept on save

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def llama_config(self) -> LlamaConfig:
        """The Llama config of the head's single layer (what its rotary embedding reads)."""
        return LlamaConfig(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            num_hidden_layers=1,
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        width = 2 * c.hidden_size
        self.q_proj = nn.Linear(width, c.num_attention_heads * c.dim, bias=False)
        self.k_proj = nn.Linear(width, c.num_key_value_heads * c.dim, bias=False)
        self.v_proj = nn.Linear(width, c.num_key_value_heads * c.dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.dim, c.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.mlp = MLP(c)


class Eagle3Head(nn.Module):
    """``fc``, ``midlayer``, ``norm``, ``lm_head`` and the vocabulary maps ``d2t``/``t2d``.

    Embeddings are the target's unless a checkpoint ships its own (``embed_tokens``), so callers
    pass embeddings, not token ids.
    """

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"EAGLE-3 heads with hidden_act {config.hidden_act!r} are not supported")
        self.config = config
        self.fc = nn.Linear(
            len(config.aux_layers) * config.target_hidden_size, config.hidden_size, bias=False
        )
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(config.llama_config())

    @property
    def draft_to_target(self) -> torch.Tensor:
        """The target token id of every logit column."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def set_vocabulary(self, target_ids: torch.Tensor) -> None:
        """Score ``target_ids`` (column j is token ``target_ids[j]``): fills ``d2t`` and ``t2d``."""
        ids = target_ids.to(self.d2t.device, torch.long)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """The target's concatenated low/middle/high hidden states as one feature ``[..., hidden]``."""
        return self.fc(target_features.to(self.fc.weight.dtype))

    def rope(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(like, positions)

    def qkv(
        self, embeds: torch.Tensor, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries ``[B, H, T, d]`` and keys, values ``[B, KV, T, d]`` of ``[B, T, hidden]``
        embeddings and features."""
        layer, c = self.midlayer, self.config
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        batch, width = x.shape[:2]
        attn = layer.self_attn
        q = attn.q_proj(x).view(batch, width, -1, c.dim).transpose(1, 2)
        k = attn.k_proj(x).view(batch, width, -1, c.dim).transpose(1, 2)
        v = attn.v_proj(x).view(batch, width, -1, c.dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *rope)
        return q, k, v

    def finish(self, attended: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output before the final norm (the next level's feature) from the
        attention's output ``[B, H, T, d]`` and the layer's input feature ``hidden``."""
        layer = self.midlayer
        batch, _, width, _ = attended.shape
        out = layer.self_attn.o_proj(attended.transpose(1, 2).reshape(batch, width, -1).to(hidden.dtype))
        residual = hidden + out
        return residual + layer.mlp(layer.post_attention_layernorm(residual))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary of output features ``[..., hidden]``."""
        return self.lm_head(self.norm(hidden))
