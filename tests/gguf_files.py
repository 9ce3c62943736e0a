"""Tiny GGUF files written in the test run with the ``gguf`` package, as llama.cpp's converter
writes them: a tiny transformers model's tensors (Llama's q/k rows permuted, linears in a block
format, norms in F32) and its byte-level BPE tokenizer as ``gpt2`` metadata. K formats hold
super-blocks of 256 weights: ``K_SIZES`` gives the tiny model rows that wide."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from multiguess.engine.quantized import FORMATS, WRITERS, format_for, format_of, quantize
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from tests.tiny_models import build_text_tokenizer, model_config, save_model

K_SIZES = {"hidden_size": 256, "intermediate_size": 256}
ARCHITECTURE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(name: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` → ``blk.3.attn_q.weight``."""
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    module, _, kind = name.rpartition(".")
    if module in top:
        return f"{top[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{NAMES[rest]}.{kind}"


def llama_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``permute`` of q/k rows (its rotary pairs adjacent dimensions)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def quantized(
    data: np.ndarray, kind: gguf.GGMLQuantizationType
) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """Blocks of ``kind`` and their type: the gguf package's writer, or multiguess's for the K
    formats it lacks, which fall back where the rows are not whole super-blocks, as llama.cpp's
    quantizer does (``format_for``)."""
    name = format_of(kind)
    if name in WRITERS:
        name = format_for(name, data.shape[1])
        return quantize(torch.from_numpy(data), name).numpy(), FORMATS[name]
    return gguf.quants.quantize(data, kind), kind


def write_gguf(
    path: Path,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    qtype: gguf.GGMLQuantizationType,
    embed_qtype: gguf.GGMLQuantizationType | None = None,
) -> Path:
    """The model's linears in ``qtype``, its token embedding in ``embed_qtype`` (default
    ``qtype``), everything else in F32."""
    config = model.config
    arch = ARCHITECTURE[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    specials = set(tokenizer.all_special_tokens)
    writer.add_token_types([3 if token in specials else 1 for token, _ in vocab])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([pair if isinstance(pair, str) else " ".join(pair) for pair in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    for name, param in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = param.detach().float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            data = llama_permute(data, heads)
        kind = embed_qtype or qtype if name == "model.embed_tokens.weight" else qtype
        if data.ndim == 2 and kind not in (gguf.GGMLQuantizationType.F32,):
            blocks, written = quantized(data, kind)
            writer.add_tensor(gguf_name(name), blocks, raw_dtype=written)
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_gguf(
    folder: Path,
    family: str,
    qtype: gguf.GGMLQuantizationType,
    seed: int = 0,
    embed_qtype: gguf.GGMLQuantizationType | None = None,
    **overrides: object,
) -> Path:
    """A tiny random model of ``family`` (hidden 64, so whole blocks of 32) written as a GGUF."""
    tokenizer = build_text_tokenizer()
    config = model_config(family, len(tokenizer), **overrides)
    source = save_model(folder / f"{family}-source", config, seed, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    return write_gguf(folder / f"{family}-{qtype.name}.gguf", model, tokenizer, qtype, embed_qtype)
