"""EAGLE-3 heads load from the ecosystem's ``LlamaForCausalLMEagle3`` layout, written here by hand
(names and shapes as SGLang, vLLM and SpecForge read them), and a head for another target is refused."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from multiguess.engine.eagle3_head import Eagle3Head
from multiguess.errors import IncompatibleDraftError, ModelLoadError
from multiguess.models.eagle3_checkpoint import is_eagle3_folder, load_head, save_head
from safetensors.torch import save_file
from transformers import LlamaConfig

HIDDEN, HEADS, KV, DIM, INTER, VOCAB, DRAFT_VOCAB = 32, 4, 2, 8, 48, 40, 12


def target_config(**overrides: object) -> LlamaConfig:
    values = dict(hidden_size=HIDDEN, num_hidden_layers=6, num_attention_heads=HEADS, vocab_size=VOCAB)
    return LlamaConfig(**(values | overrides))


def published_weights(seed: int, prefix: str = "", embeddings: bool = False) -> dict[str, torch.Tensor]:
    """A head's tensors under the names and shapes published heads use."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    hot = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[hot] = True
    weights = {
        "midlayer.self_attn.q_proj.weight": rand(HEADS * DIM, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": rand(KV * DIM, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": rand(KV * DIM, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": rand(HIDDEN, HEADS * DIM),
        "midlayer.mlp.gate_proj.weight": rand(INTER, HIDDEN),
        "midlayer.mlp.up_proj.weight": rand(INTER, HIDDEN),
        "midlayer.mlp.down_proj.weight": rand(HIDDEN, INTER),
        "midlayer.input_layernorm.weight": rand(HIDDEN),
        "midlayer.hidden_norm.weight": rand(HIDDEN),
        "midlayer.post_attention_layernorm.weight": rand(HIDDEN),
        "fc.weight": rand(HIDDEN, 3 * HIDDEN),
        "norm.weight": rand(HIDDEN),
        "lm_head.weight": rand(DRAFT_VOCAB, HIDDEN),
        "d2t": hot - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }
    if embeddings:
        weights["embed_tokens.weight"] = rand(VOCAB, HIDDEN)
    return {prefix + name: tensor for name, tensor in weights.items()}


def write_published(folder: Path, weights: dict[str, torch.Tensor], **config: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    raw = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "intermediate_size": INTER,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    } | config
    (folder / "config.json").write_text(json.dumps(raw))
    save_file(weights, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("prefix", ["", "model."])
def test_a_published_head_loads_with_its_own_names(tmp_path: Path, prefix: str) -> None:
    weights = published_weights(0, prefix)
    folder = write_published(
        tmp_path / "head", weights, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    )
    assert is_eagle3_folder(folder)
    head, embed = load_head(folder, target_config(), torch.float32)
    assert embed is None  # the target's embeddings are used
    assert head.config.aux_layers == (1, 3, 4)
    state = head.state_dict()
    for name, tensor in weights.items():
        assert torch.equal(state[name.removeprefix(prefix)], tensor), name
    hot = torch.nonzero(weights[prefix + "t2d"]).flatten()
    assert torch.equal(head.draft_to_target, hot)


def test_default_feature_layers_and_shipped_embeddings(tmp_path: Path) -> None:
    weights = published_weights(1, embeddings=True)
    folder = write_published(tmp_path / "head", weights)
    head, embed = load_head(folder, target_config(num_hidden_layers=30), torch.float32)
    assert head.config.aux_layers == (2, 15, 27)  # low, middle, high, as SGLang and vLLM pick them
    assert embed is not None and torch.equal(embed.weight, weights["embed_tokens.weight"])


def test_a_head_without_maps_scores_every_token(tmp_path: Path) -> None:
    weights = {k: v for k, v in published_weights(2).items() if k not in ("d2t", "t2d")}
    weights["lm_head.weight"] = torch.randn(VOCAB, HIDDEN)
    folder = write_published(tmp_path / "head", weights, draft_vocab_size=None)
    head, _ = load_head(folder, target_config(), torch.float32)
    assert torch.equal(head.draft_to_target, torch.arange(VOCAB))


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (target_config(vocab_size=VOCAB + 1), "vocabulary 40 (target: 41)"),
        (
            target_config(hidden_size=HIDDEN * 2, num_attention_heads=HEADS),
            "target hidden size 32 (target: 64)",
        ),
        (target_config(num_hidden_layers=2), "feature layers"),
    ],
)
def test_a_head_for_another_target_is_refused(tmp_path: Path, target: LlamaConfig, message: str) -> None:
    folder = write_published(
        tmp_path / "head", published_weights(3), eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    )
    with pytest.raises(IncompatibleDraftError, match="made for another target") as err:
        load_head(folder, target, torch.float32)
    assert message in str(err.value)


def test_broken_heads_are_refused_clearly(tmp_path: Path) -> None:
    not_eagle = write_published(tmp_path / "llama", published_weights(4), architectures=["LlamaForCausalLM"])
    with pytest.raises(ModelLoadError, match="not an EAGLE-3 head"):
        load_head(not_eagle, target_config(), torch.float32)
    weights = published_weights(4)
    weights["d2t"] = weights["d2t"] + VOCAB
    with pytest.raises(ModelLoadError, match="d2t maps draft ids outside"):
        load_head(write_published(tmp_path / "d2t", weights), target_config(), torch.float32)
    weights = published_weights(4)
    weights["t2d"] = ~weights["t2d"]
    with pytest.raises(ModelLoadError, match="t2d does not mark"):
        load_head(write_published(tmp_path / "t2d", weights), target_config(), torch.float32)
    weights = published_weights(4)
    del weights["fc.weight"]
    with pytest.raises(ModelLoadError, match=re.escape("missing ['fc.weight']")):
        load_head(write_published(tmp_path / "fc", weights), target_config(), torch.float32)


def test_save_writes_the_published_layout(tmp_path: Path) -> None:
    source = write_published(tmp_path / "in", published_weights(5))
    head, _ = load_head(source, target_config(), torch.float32)
    save_head(head, tmp_path / "out", torch.float32)
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]
    assert raw["draft_vocab_size"] == DRAFT_VOCAB and raw["vocab_size"] == VOCAB
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "out" / "model.safetensors")).keys() == published_weights(5).keys()
    again, _ = load_head(tmp_path / "out", target_config(), torch.float32)
    assert isinstance(again, Eagle3Head)
    for name, tensor in head.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
