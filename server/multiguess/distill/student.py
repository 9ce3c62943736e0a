"""The draft's shape and initialisation: a narrow, shallow Llama sharing the target's vocabulary.

The output layer (vocab x width) dominates a small draft's cost, so width is what buys speed;
depth buys quality cheaply. Starting the tied embeddings from a projection of the target's onto
its top principal directions gives the draft the target's token geometry from step 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftShape:
    hidden_size: int = 256
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 768


def draft_config(target_config, shape: DraftShape):
    """A LlamaConfig with the target's vocabulary, special tokens and rope, at the draft's shape."""
    from transformers import LlamaConfig

    rope = getattr(target_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    return LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.hidden_size // shape.num_attention_heads,
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_parameters=dict(rope),
        tie_word_embeddings=True,
        bos_token_id=target_config.bos_token_id,
        eos_token_id=target_config.eos_token_id,
        pad_token_id=target_config.pad_token_id,
    )


def projected_embeddings(embeddings: torch.Tensor, width: int) -> torch.Tensor:
    """Project [vocab, d] onto its top ``width`` right-singular directions, keeping dot products.

    Uncentred on purpose: logits are dot products with these rows, and the uncentred SVD is the
    rank-``width`` approximation that best preserves them.
    """
    if width > embeddings.shape[1]:
        raise ValueError(f"draft width {width} exceeds the target's embedding width {embeddings.shape[1]}")
    _, _, vh = torch.linalg.svd(embeddings.float(), full_matrices=False)
    return embeddings.float() @ vh[:width].T


def build_draft(target, shape: DraftShape, seed: int = 0):
    """A fresh draft with embeddings projected from the target's (fp32, ready to train)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    draft = LlamaForCausalLM(draft_config(target.config, shape)).float()
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(
            projected_embeddings(target.get_input_embeddings().weight, shape.hidden_size)
        )
        calibrate_logit_scale(draft, seed)
    return draft


def calibrate_logit_scale(draft, seed: int, target_std: float = 1.0) -> None:
    """Scale the final norm so that initial logits have std ``target_std``.

    A fresh body points its final states in arbitrary directions; with large logits that makes
    the initial loss far above log(vocab) and the first steps are spent shrinking them.
    """
    ids = torch.randint(0, draft.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(seed))
    std = draft(input_ids=ids).logits.float().std().item()
    draft.model.norm.weight.mul_(target_std / std)
