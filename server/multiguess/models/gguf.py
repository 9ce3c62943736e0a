"""Load a GGUF checkpoint as it ships: quantized linears stay in their blocks.

transformers reads a GGUF by dequantizing every tensor to floats, which multiplies the bytes a
decode step streams (the embedded Q4_1 target: 94 MiB of blocks, 270 MB in bf16). Here only the
metadata goes through transformers' GGUF conversion (the config and the tokenizer); the
tensors are read with the ``gguf`` package. Linear weights in a block format become
``QuantizedLinear`` modules holding the file's bytes, the token embedding a
``QuantizedEmbedding``; norms, biases and float tensors become ordinary parameters.
llama.cpp's converter permutes the rows of Llama's q and k projections (its rotary pairs
adjacent dimensions); the rows are permuted back, whole blocks at a time.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from multiguess.cache_dirs import cache_roots, readable_by_all
from multiguess.engine.quantized import FORMATS, QuantizedEmbedding, QuantizedLinear, format_of
from multiguess.errors import ModelLoadError, UnsupportedModelError

# GGUF ``general.architecture`` values (llama.cpp writes Mistral models as ``llama``).
ARCHITECTURES = ("llama", "qwen2", "qwen3")
FLOATS = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
IN_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def is_gguf(name: str) -> bool:
    """Whether a model name is a GGUF file (by its suffix: the file may not exist yet)."""
    return name.lower().endswith(".gguf")


def supported_types() -> str:
    return ", ".join([*(t.name for t in FLOATS), *(FORMATS[k].name for k in FORMATS)])


def module_path(tensor_name: str) -> tuple[str, str]:
    """``blk.3.attn_q.weight`` → (``model.layers.3.self_attn.q_proj``, ``weight``)."""
    parts = tensor_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in IN_LAYER:
        return f"model.layers.{parts[1]}.{IN_LAYER[parts[2]]}", parts[3]
    if len(parts) == 2 and parts[0] in TOP:
        return TOP[parts[0]], parts[1]
    raise UnsupportedModelError(f"GGUF tensor {tensor_name!r} has no place in a Llama/Qwen2/Qwen3 model")


def llama_rows(out_features: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation: row ``i`` of the model's weight is
    row ``rows[i]`` of the file's (transformers' ``reverse_permute_weights``, on row indices)."""
    half = out_features // heads // 2
    return torch.arange(out_features).view(heads, half, 2).transpose(1, 2).reshape(-1)


def scalar(reader: GGUFReader, key: str) -> object | None:
    """A metadata value (a string or a number), or None where the file lacks it."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def check_file(reader: GGUFReader, path: Path) -> str:
    """The file's architecture; a clear error for one or a tensor type this loader lacks."""
    architecture = scalar(reader, "general.architecture") or "unknown"
    if architecture not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path.name}: GGUF architecture {architecture!r} is not supported; supported: "
            f"{', '.join(ARCHITECTURES)} (Mistral files are llama)"
        )
    for tensor in reader.tensors:
        if tensor.tensor_type not in FLOATS and format_of(tensor.tensor_type) is None:
            raise UnsupportedModelError(
                f"{path.name}: tensor {tensor.name} is {tensor.tensor_type.name}, which multiguess "
                f"does not read; supported tensor types: {supported_types()}"
            )
    return architecture


def float_tensor(tensor: ReaderTensor, dtype: torch.dtype) -> torch.Tensor:
    data = np.array(tensor.data)
    if tensor.tensor_type == GGMLQuantizationType.BF16:
        return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16).to(dtype)
    return torch.from_numpy(data).to(dtype)


def place(
    model: torch.nn.Module, tensor: ReaderTensor, config: PretrainedConfig, llama: bool, dtype: torch.dtype
) -> None:
    """One GGUF tensor into the skeleton: a float parameter, or a quantized module in the place
    of the Linear (or Embedding) it stands for."""
    path, kind = module_path(tensor.name)
    parent_path, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    module = getattr(parent, child)
    quantized = format_of(tensor.tensor_type)
    data = torch.from_numpy(np.array(tensor.data)) if quantized else float_tensor(tensor, dtype)
    if llama and child in ("q_proj", "k_proj"):
        heads = config.num_attention_heads if child == "q_proj" else config.num_key_value_heads
        data = data[llama_rows(data.shape[0], heads)]
    if quantized is None:
        setattr(module, kind, torch.nn.Parameter(data.contiguous(), requires_grad=False))
    elif isinstance(module, torch.nn.Embedding):
        setattr(parent, child, QuantizedEmbedding(data, quantized, module.embedding_dim, dtype))
    elif kind == "weight" and isinstance(module, torch.nn.Linear):
        bias = module.bias if module.bias is not None and module.bias.device.type != "meta" else None
        setattr(parent, child, QuantizedLinear(data, quantized, module.in_features, bias))
    else:
        raise UnsupportedModelError(
            f"GGUF tensor {tensor.name} is {tensor.tensor_type.name}; only weights of Linear layers and embeddings may be quantized"
        )


def tie_head(model: torch.nn.Module) -> None:
    """A file without ``output.weight`` reads its LM head from the token embedding."""
    embed = model.model.embed_tokens
    if isinstance(embed, QuantizedEmbedding):
        model.lm_head = QuantizedLinear(embed.blocks, embed.kind, embed.dim)
    else:
        model.lm_head.weight = embed.weight


def metadata_folder(path: Path) -> Path:
    """Where a file's converted config and tokenizer are kept: by its path, size and time, in the
    first cache folder that has them (else where they are written)."""
    stat = path.resolve().stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    places = [root / "gguf" / f"{path.stem}-{key}" for root in cache_roots()]
    return next((p for p in places if (p / "tokenizer.json").is_file()), places[0])


def metadata(path: Path) -> tuple[PretrainedConfig, object]:
    """The config and tokenizer, converted by transformers from the file's metadata once (its
    reader parses a large vocabulary in seconds, twice) and from the cache afterwards."""
    folder = metadata_folder(path)
    try:
        if not (folder / "tokenizer.json").is_file():
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            folder.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
            config.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            readable_by_all(staging)
            try:
                staging.rename(folder)  # whole or absent: a concurrent loader may have won
            except OSError:
                shutil.rmtree(staging, ignore_errors=True)
        return AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read {path.name}'s metadata: {exc}") from exc


def load_gguf(path: Path, dtype: torch.dtype) -> tuple[torch.nn.Module, object]:
    """The model (on the CPU, in eval mode) and tokenizer of a GGUF file; float tensors and
    activations in ``dtype``."""
    if not path.is_file():
        raise ModelLoadError(f"cannot load model {str(path)!r}: no such GGUF file")
    reader = GGUFReader(path)
    architecture = check_file(reader, path)
    config, tokenizer = metadata(path)
    head_dim = scalar(reader, f"{architecture}.attention.key_length")
    if head_dim is not None:  # Qwen3's heads need not be hidden_size / heads wide
        config.head_dim = int(head_dim)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for tensor in reader.tensors:
        place(model, tensor, config, architecture == "llama", dtype)
    if "output.weight" not in {t.name for t in reader.tensors}:
        tie_head(model)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its tables, off meta
    missing = [
        name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"
    ]
    if missing:
        raise ModelLoadError(f"{path.name} lacks tensors the model needs: {', '.join(missing[:5])}")
    return model.eval(), tokenizer
