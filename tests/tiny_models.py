"""Tiny random-weight models and a word-level tokenizer, built in the test run (no hub).

They exercise exactly the code paths of real checkpoints: transformers writes and reads the
folders, and the engine loads them like any other model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
WORDS = [f"w{i}" for i in range(60)]
# Multi-byte tokens of the text tokenizer, byte-level spelled (Ġ is a space, Ċ a newline).
JSON_PIECES = ['{"', '":Ġ', ',Ġ"', '"}', '"]', '["', "ĠĠ", "Ċ}", "true", "false", "null", "name", "age"]


def build_tokenizer(words: list[str] = WORDS) -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return _fast(backend)


def build_text_tokenizer(
    symbols: list[str] | None = None, pieces: list[str] = JSON_PIECES
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer, as GPT-2-style models have: single-byte ``symbols`` (every
    byte by default) and multi-byte ``pieces`` built by merges, so it writes and reads any text
    and a grammar engine can tell each token's bytes."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet()) if symbols is None else symbols
    words = list(alphabet)
    merges = []
    for piece in pieces:
        for end in range(2, len(piece) + 1):
            if piece[:end] not in words:
                words.append(piece[:end])
                merges.append((piece[: end - 1], piece[end - 1]))
    vocab = {tok: i for i, tok in enumerate(SPECIALS + words)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return _fast(backend)


def _fast(backend: Tokenizer) -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}w0{% endif %}"
    )
    return tokenizer


def model_config(family: str, vocab_size: int, **overrides: object) -> PretrainedConfig:
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(head_dim=16, **common)
    if family == "mistral":
        return MistralConfig(**common)
    raise ValueError(family)


def save_model(folder: Path, config: object, seed: int, tokenizer: PreTrainedTokenizerFast) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        # Sharper logits than the default init, so greedy choices are rarely near-ties.
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_noisy_copy(source: Path, folder: Path, noise: float, seed: int) -> Path:
    """A draft that agrees with the target partly: the target's weights plus Gaussian noise."""
    model = AutoModelForCausalLM.from_pretrained(source)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * noise * param.std())
    model.save_pretrained(folder)
    PreTrainedTokenizerFast.from_pretrained(source).save_pretrained(folder)
    return folder
