"""llama.cpp built from the ``llama-cpp-python`` sdist on PyPI, once per version and CPU.

The sdist vendors llama.cpp under ``vendor/llama.cpp``, so PyPI is the only source needed. Only
``llama-server`` is built (native flags, static, no web UI), together with the HF→GGUF
converter that ships beside it. The result lives in the project's cache (``cache_roots()``)
under ``llama.cpp/<version>-<cpu key>``: the key hashes the CPU's feature flags, because a
native build uses the instructions of the machine that compiled it. The folder is staged and
renamed into place, so an interrupted build leaves nothing that passes for a finished one.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))

from multiguess.cache_dirs import cache_roots

VERSION = "0.3.36"  # llama-cpp-python; its sdist pins the llama.cpp commit it vendors
SERVER = "llama-server"
CONVERTER = ("convert_hf_to_gguf.py", "conversion", "gguf-py")
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)


class BuildUnavailable(RuntimeError):
    """llama.cpp cannot be built here (no compiler, no build tools); the message says why."""


@dataclass(frozen=True)
class LlamaCpp:
    """A finished build: the server binary and the converter's folder."""

    folder: Path

    @property
    def server(self) -> Path:
        return self.folder / "bin" / SERVER

    @property
    def converter(self) -> Path:
        return self.folder / "convert" / CONVERTER[0]

    def is_complete(self) -> bool:
        return self.server.is_file() and self.converter.is_file()


def cpu_flags(cpuinfo: str) -> list[str]:
    """The sorted feature flags of the first CPU in a ``/proc/cpuinfo`` text (``flags`` on x86,
    ``Features`` on Arm); empty where the text has neither."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return sorted(set(value.split()))
    return []


def build_key(version: str, machine: str, flags: list[str]) -> str:
    """``<version>-<12 hex>``: one folder per llama-cpp-python version, architecture and flag set."""
    digest = hashlib.sha256(" ".join([machine, *flags]).encode()).hexdigest()[:12]
    return f"{version}-{digest}"


def this_machine_key(version: str = VERSION) -> str:
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.is_file() else ""
    return build_key(version, platform.machine(), cpu_flags(text))


def cached_build(version: str = VERSION) -> LlamaCpp:
    """Where this machine's build of ``version`` lives (finished or not)."""
    return LlamaCpp(cache_roots()[0] / "llama.cpp" / this_machine_key(version))


def missing_compiler() -> str | None:
    """Why nothing can be compiled here, or None when a C and a C++ compiler are on PATH."""
    if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
        return "no C compiler on PATH (cc, gcc or clang); install one (e.g. apt-get install g++)"
    if not any(shutil.which(cxx) for cxx in ("c++", "g++", "clang++")):
        return "no C++ compiler on PATH (c++, g++ or clang++); install one (e.g. apt-get install g++)"
    return None


def cmake_command(source: Path, build: Path, generator: str | None) -> list[str]:
    """The configure step: native Release build of the static server, nothing else."""
    return [
        "cmake",
        "-S",
        str(source),
        "-B",
        str(build),
        *(["-G", generator] if generator else []),
        *CMAKE_OPTIONS,
    ]


def build_tools(scratch: Path) -> dict[str, str]:
    """PATH for cmake and ninja: the system's, else pip's ``cmake``/``ninja`` wheels into ``scratch``."""
    path = os.environ.get("PATH", "")
    missing = [tool for tool in ("cmake", "ninja") if not shutil.which(tool)]
    if missing:
        target = scratch / "tools"
        print(
            f"llama.cpp: installing {' '.join(missing)} from PyPI into {target}", file=sys.stderr, flush=True
        )
        pip = [sys.executable, "-m", "pip", "install", "-q", "--target", str(target), *missing]
        if subprocess.run(pip, check=False).returncode != 0:
            raise BuildUnavailable(f"cmake/ninja missing and `pip install {' '.join(missing)}` failed")
        path = f"{target / 'bin'}{os.pathsep}{path}"
    return {**os.environ, "PATH": path}


def download_source(scratch: Path, version: str) -> Path:
    """The sdist from PyPI, unpacked; returns its ``vendor/llama.cpp``."""
    pip = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
    subprocess.run([*pip, "-q", "-d", str(scratch), f"llama-cpp-python=={version}"], check=True)
    archive = next(scratch.glob(f"llama_cpp_python-{version}.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(scratch, filter="data")
    return scratch / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def run_logged(command: list[str], env: dict[str, str], started: float) -> None:
    """Run a build step, echoing its lines with the elapsed time (a 15-minute build shows progress)."""
    print(f"llama.cpp: $ {' '.join(command)}", file=sys.stderr, flush=True)
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(f"[{time.monotonic() - started:6.0f} s] {line.rstrip()}", file=sys.stderr, flush=True)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, command)


def build(version: str = VERSION, jobs: int | None = None) -> LlamaCpp:
    """This machine's build of ``version``, compiling it first when the cache lacks it."""
    done = cached_build(version)
    if done.is_complete():
        return done
    reason = missing_compiler()
    if reason:
        raise BuildUnavailable(reason)
    done.folder.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llama-cpp-build-") as tmp:
        scratch = Path(tmp)
        env = build_tools(scratch)
        print(f"llama.cpp: downloading the llama-cpp-python {version} sdist", file=sys.stderr, flush=True)
        source = download_source(scratch, version)
        out = scratch / "build"
        generator = "Ninja" if shutil.which("ninja", path=env["PATH"]) else None
        run_logged(cmake_command(source, out, generator), env, started)
        parallel = ["-j", str(jobs or os.cpu_count() or 1)]
        run_logged(["cmake", "--build", str(out), "--target", SERVER, *parallel], env, started)
        staging = Path(tempfile.mkdtemp(prefix=f".{done.folder.name}-", dir=done.folder.parent))
        (staging / "bin").mkdir()
        shutil.copy2(out / "bin" / SERVER, staging / "bin" / SERVER)
        (staging / "convert").mkdir()
        for name in CONVERTER:
            if (source / name).is_dir():
                shutil.copytree(source / name, staging / "convert" / name)
            else:
                shutil.copy2(source / name, staging / "convert" / name)
        staging.rename(done.folder)
    print(
        f"llama.cpp: built {SERVER} in {time.monotonic() - started:.0f} s into {done.folder}", file=sys.stderr
    )
    return done


if __name__ == "__main__":
    try:
        print(build().server)
    except BuildUnavailable as error:
        print(f"llama.cpp: skipped: {error}", file=sys.stderr)
