"""Load targets and drafts with transformers, and check that a draft can serve a target."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from multiguess.engine.loaded_model import LoadedModel
from multiguess.engine.quantized import FORMATS, quantize_linears
from multiguess.errors import IncompatibleDraftError, ModelLoadError, UnsupportedModelError
from multiguess.models.draft_vocab import load_draft_vocab
from multiguess.models.gguf import is_gguf, load_gguf
from multiguess.models.gguf import metadata as gguf_metadata
from multiguess.options import QUANTIZATIONS

log = logging.getLogger(__name__)

# Decoder-only families whose layers share the Llama layout (pre-norm, rotary q/k/v/o, gated
# MLP) that the native runner drives: Qwen2 adds q/k/v biases, Qwen3 adds q/k norms.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> str:
    """``auto``: the first GPU when one is visible, else the CPU."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """``auto``: what ``auto_dtype`` picks for the model's own device; else the named dtype."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
        return DTYPES[name]
    if device.startswith("cuda"):
        return auto_dtype("cuda", cuda_capability=torch.cuda.get_device_capability(torch.device(device)))
    from multiguess.engine.backends import cpu_has_fast_bf16

    return auto_dtype("cpu", cpu_bf16=cpu_has_fast_bf16())


def auto_dtype(
    device_type: str, cuda_capability: tuple[int, int] | None = None, cpu_bf16: bool = False
) -> torch.dtype:
    """bf16 only where the device computes it natively: CUDA compute capability 8.0 or newer
    (A100, H100; a V100 emulates it, and ``torch.cuda.is_bf16_supported()`` says yes there too)
    and CPUs with bf16 instructions; else fp16 on GPUs and fp32 on CPUs."""
    if device_type == "cuda":
        return torch.bfloat16 if cuda_capability is not None and cuda_capability >= (8, 0) else torch.float16
    return torch.bfloat16 if cpu_bf16 else torch.float32


def check_architecture(config: object, name: str) -> None:
    if "LlamaForCausalLMEagle3" in (getattr(config, "architectures", None) or []):
        raise UnsupportedModelError(
            f"{name} is an EAGLE-3 head, not a causal LM: it drafts beside its target with --drafter eagle3"
        )
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{name}: architecture {model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def load_model(
    name: str,
    dtype: str = "auto",
    device: str = "auto",
    quantization: str = "auto",
) -> LoadedModel:
    """Load a causal LM and its tokenizer from a local folder, a hub id or a GGUF file.

    ``quantization="auto"`` keeps the weights as the checkpoint stores them: a GGUF's blocks
    (CPU only), a safetensors model's floats; ``none`` loads floats, dequantizing a GGUF.
    ``int8`` is Q8_0 blocks (integer weights on the integer kernels, in the place of torch's
    deprecated dynamic int8 quantization). A block format
    (``q8_0``, ``q4_0``, ``q4_1``, ``q4_k``, ``q6_k``) keeps every Linear in that format's blocks,
    as a GGUF file's quantized linears are kept (CPU only; ``dtype`` is then the activations' and
    float tensors'; ``quantize_linears`` says what a K format does with rows not a multiple of 256).
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}; got {quantization!r}")
    device = resolve_device(device)
    if is_gguf(name):
        return load_gguf_model(name, dtype, device, quantization)
    quantization = {"auto": "none", "int8": "q8_0"}.get(quantization, quantization)
    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model {name!r}: {exc}") from exc
    check_architecture(config, name)
    blocks = quantization in FORMATS
    torch_dtype = resolve_dtype(dtype, device)
    if quantization != "none" and not device.startswith("cpu"):
        raise ValueError(f"{quantization} quantization runs on the CPU only; use quantization='none'")
    try:
        # Blocks are quantized from the checkpoint's fp32 weights, whatever the activations' dtype.
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32 if blocks else torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model {name!r}: {exc}") from exc
    model.to(device)
    model.eval()
    if blocks:
        quantize_linears(model, quantization)
        model.to(torch_dtype)  # norms, embeddings and biases; the blocks stay uint8
    log.info("loaded %s (%s, %s, quantization=%s)", name, config.model_type, torch_dtype, quantization)
    draft_vocab = load_draft_vocab(name, config.vocab_size)
    return LoadedModel(model, tokenizer, name, torch.device(device), torch_dtype, draft_vocab)


def load_gguf_model(name: str, dtype: str, device: str, quantization: str) -> LoadedModel:
    """A GGUF file: ``auto`` keeps its quantized linears in their blocks (``models/gguf.py``,
    CPUs only); ``none`` dequantizes it to float weights (transformers' reader), for any device."""
    if quantization == "none":
        return load_dequantized_gguf(Path(name), dtype, device)
    if quantization != "auto":
        raise ValueError(
            f"{name} is quantized already (a GGUF file): --quantization auto serves its blocks, "
            "none dequantizes it; the block formats apply to safetensors models"
        )
    if not device.startswith("cpu"):
        raise UnsupportedModelError(
            f"{name}: GGUF blocks run on CPUs only (multiguess's integer kernels); use --device cpu, "
            "or --quantization none to dequantize it to float weights for a GPU"
        )
    torch_dtype = resolve_dtype(dtype, device)
    model, tokenizer = load_gguf(Path(name), torch_dtype)
    check_architecture(model.config, name)
    log.info("loaded %s (GGUF, %s, activations %s)", name, model.config.model_type, torch_dtype)
    return LoadedModel(model, tokenizer, name, torch.device("cpu"), torch_dtype)


def load_dequantized_gguf(path: Path, dtype: str, device: str) -> LoadedModel:
    """A GGUF file's weights decoded to ``dtype`` floats by transformers, on ``device``."""
    if not path.is_file():
        raise ModelLoadError(f"cannot load model {str(path)!r}: no such GGUF file")
    torch_dtype = resolve_dtype(dtype, device)
    config, tokenizer = gguf_metadata(path)
    check_architecture(config, str(path))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch_dtype)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model {str(path)!r}: {exc}") from exc
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.to(device).eval()
    log.info("loaded %s (GGUF dequantized, %s, %s)", path, config.model_type, torch_dtype)
    return LoadedModel(model, tokenizer, str(path), torch.device(device), torch_dtype)


def check_draft_compatible(target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase) -> None:
    """Refuse a draft whose token ids mean something else than the target's."""
    if target.get_vocab() != draft.get_vocab():
        raise IncompatibleDraftError(
            "the draft's tokenizer has a different vocabulary from the target's; "
            "a draft must share the target's tokenizer"
        )
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(target, attr) != getattr(draft, attr):
            raise IncompatibleDraftError(
                f"the draft's {attr} ({getattr(draft, attr)}) differs from the target's "
                f"({getattr(target, attr)}); a draft must share the target's special tokens"
            )
