"""Where a result came from: the commit of the code that made it, when, and on what machine.

Benchmarks record it beside their numbers and ``multiguess distill`` beside its exports; cheap
(git and /proc/cpuinfo only; torch is asked about a GPU only when already imported).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path


def provenance() -> dict[str, str]:
    """What a result needs to be traced: the commit measured, when, and on what machine."""
    return {
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
    }


# What benchmarks write (results, the pages rendered from them): a run after another in the same
# checkout measures the same code, so these do not make it dirty.
RESULTS = ("docs/bench", "docs/img", "docs/BENCHMARKS.md", "README.md")


def git_commit() -> str:
    """The short commit of the checkout this code runs from, with ``-dirty`` when tracked files
    other than benchmark results (``RESULTS``) differ from it; ``unknown`` outside a git checkout
    (an installed wheel)."""
    here = Path(__file__).parent
    outside = [f":(top,exclude){path}" for path in RESULTS]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--", ":/", *outside], cwd=here, capture_output=True
        ).returncode
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def machine() -> str:
    """CPU model, usable cores and the matrix/bf16 instructions that decide kernel choice, plus
    the GPU when torch sees one (only if torch is already imported: this must stay cheap)."""
    name, flags = platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == platform.machine():
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    isa = [label for flag, label in (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX")) if flag in flags]
    if not isa and "avx2" in flags:  # the bf16 kernels' AVX2 build (engine/backends/cpu/bf16_kernel.py)
        isa = ["AVX2, no AVX512"]
    description = f"{name}, {cores} cores" + (f" ({', '.join(isa)})" if isa else "")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        description += f"; GPU {torch.cuda.get_device_name(0)}"
    return description
