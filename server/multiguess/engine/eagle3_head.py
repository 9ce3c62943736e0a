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
The same math serves drafting (``engine/drafters/eagle3.py``, over a KV cache) and training
(``distill/eagle3_train.py``, all positions at once): the attention is left to the caller. The
linears run as ``Projection``s: trainable views of the modules' weights by default, the device
family's fused and repacked form once ``for_drafting`` (on CPUs multiguess's bf16 panels, with
the norms, the gating and the residual adds inside the kernel call).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from multiguess.engine.linear import Projection, rms_norm


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
    """Llama's RMSNorm (normalised in fp32, scaled in the input's dtype), as the fused kernels compute it."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(self, x)


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


class MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.mlp = MLP(c)


class Joined(Projection):
    """Linear layers run as one product over their weights joined at each call: the trainable
    form of a fused projection (gradients reach every module's own weight)."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.linears = linears
        self.bias = None
        self.sizes = [m.out_features for m in linears]

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]  # computed, never assigned
        return (
            torch.cat([m.weight for m in self.linears]) if len(self.linears) > 1 else self.linears[0].weight
        )


@dataclass
class HeadProjections:
    """The head's linears grouped as they run: q/k/v and gate/up each as one product."""

    fc: Projection
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    lm_head: Projection

    @staticmethod
    def groups(head: Eagle3Head) -> dict[str, list[nn.Linear]]:
        attn, mlp = head.midlayer.self_attn, head.midlayer.mlp
        return {
            "fc": [head.fc],
            "qkv": [attn.q_proj, attn.k_proj, attn.v_proj],
            "o": [attn.o_proj],
            "gate_up": [mlp.gate_proj, mlp.up_proj],
            "down": [mlp.down_proj],
            "lm_head": [head.lm_head],
        }

    @classmethod
    def trainable(cls, head: Eagle3Head) -> HeadProjections:
        return cls(**{name: Joined(linears) for name, linears in cls.groups(head).items()})

    @classmethod
    def fused(cls, head: Eagle3Head, projection: type[Projection]) -> HeadProjections:
        """``projection``'s fused form of every group (the modules' weights become views of it)."""
        built = {name: projection.of(linears) for name, linears in cls.groups(head).items()}
        if any(p is None for p in built.values()):
            raise ValueError("EAGLE-3 heads with quantized or non-Linear layers are not supported")
        return cls(**built)  # type: ignore[arg-type]  # None ruled out above


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
        self.projections = HeadProjections.trainable(self)

    @torch.no_grad()
    def for_drafting(self, projection: type[Projection]) -> None:
        """Run the linears as ``projection``'s fused form (the device family's kernels): for
        drafting only, since the fused weights no longer train. Call after the weights are loaded."""
        self.projections = HeadProjections.fused(self, projection)

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
        return self.projections.fc(target_features.to(self.fc.weight.dtype))

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
        q, k, v = (
            part.view(batch, width, -1, c.dim).transpose(1, 2) for part in self.projections.qkv.split(x)
        )
        q, k = apply_rotary_pos_emb(q, k, *rope)
        return q, k, v

    def finish(self, attended: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output before the final norm (the next level's feature) from the
        attention's output ``[B, H, T, d]`` and the layer's input feature ``hidden``."""
        p = self.projections
        batch, _, width, _ = attended.shape
        flat = attended.transpose(1, 2).reshape(batch, width, -1).to(hidden.dtype)
        residual = p.o(flat, residual=hidden)
        gate_up = p.gate_up(residual, norm=self.midlayer.post_attention_layernorm)
        return p.down(gate_up, gated=True, residual=residual)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary of output features ``[..., hidden]``."""
        return self.projections.lm_head(hidden, norm=self.norm)
