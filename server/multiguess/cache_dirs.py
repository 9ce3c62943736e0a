"""Where prepared files live: converted models and compiled kernels, found and written alike.

A module of its own, below both the models and the kernels, because each of them keeps files
there and neither should import the other to learn where.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_roots() -> list[Path]:
    """Where prepared files (converted models, compiled kernels) are looked for, in order:
    ``$MULTIGUESS_CACHE_DIR`` (the cache volume the operator mounts on pods), ``$MULTIGUESS_CACHE``
    (the image bakes the embedded pair and the kernels there, read-only), else
    ``~/.cache/multiguess``. New files go to the first."""
    configured = [os.environ.get(name) for name in ("MULTIGUESS_CACHE_DIR", "MULTIGUESS_CACHE")]
    roots = [Path(c).expanduser() for c in configured if c]
    return list(dict.fromkeys(roots)) or [Path.home() / ".cache" / "multiguess"]


def readable_by_all(folder: Path) -> None:
    """Open a prepared folder (made owner-only by ``tempfile.mkdtemp``, and safetensors writes
    weights owner-only) to every user: an image bakes its cache as root and serves it as uid
    10001."""
    for file in folder.iterdir():
        file.chmod(0o644)
    folder.chmod(0o755)
