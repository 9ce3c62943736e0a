"""The wheel carries every file the installed package reads at run time, and no docs tooling: a
pip-installed server (the image installs one) compiles the CPU kernels from the sources and
headers inside it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from multiguess.engine.backends.cpu import bf16_kernel, quant_kernel

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_the_kernel_sources_and_headers(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy: the build writes its scratch folders beside the sources
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("server", "operator"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("multiguess-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    needed = [
        path.relative_to(ROOT / "server").as_posix()
        for sources in (bf16_kernel.BF16, quant_kernel.QUANT)
        for path in (*sources.files, *sources.headers)
    ]
    assert len(needed) >= 3, "the kernel sources were not found beside bf16_kernel.py"
    missing = [name for name in needed if name not in names]
    assert not missing, f"not in the wheel: {missing}"
    # The docs renderer is a development tool (bench/bench_docs.py), not part of what is served.
    assert not [name for name in names if name.endswith("bench_docs.py")]
