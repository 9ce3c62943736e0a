"""Offline text for distillation: documentation, licences and Python sources already on the machine.

No hub downloads are possible, so the plain text the target is run over (teacher-forced) comes
from files every Python/Debian install carries. Paragraph-sized chunks double as material for
summarisation prompts.
"""

from __future__ import annotations

import hashlib
import re
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

TEXT_SUFFIXES = (".md", ".rst", ".txt")
MAX_FILE_BYTES = 400_000


def default_roots() -> list[Path]:
    """Doc folders, licences, the standard library and installed packages of this interpreter."""
    roots = [
        Path("/usr/share/doc"),
        Path("/usr/share/common-licenses"),
        Path(sysconfig.get_paths()["stdlib"]),
    ]
    roots += [Path(p) for p in sys.path if p.endswith("site-packages")]
    return [r for r in roots if r.is_dir()]


def iter_files(roots: Sequence[Path], suffixes: tuple[str, ...]) -> Iterator[Path]:
    """Readable files under the roots with one of the suffixes, in a stable order."""
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.suffix in suffixes and path.is_file() and 200 < path.stat().st_size < MAX_FILE_BYTES:
                yield path


def split_chunks(text: str, min_chars: int = 300, max_chars: int = 1500) -> list[str]:
    """Greedy paragraph packing: blank-line separated blocks joined up to ``max_chars``."""
    chunks: list[str] = []
    current = ""
    for block in re.split(r"\n\s*\n", text):
        block = block.strip()
        if not block:
            continue
        if current and len(current) + len(block) + 2 > max_chars:
            if len(current) >= min_chars:
                chunks.append(current)
            current = ""
        current = f"{current}\n\n{block}" if current else block[:max_chars]
    if len(current) >= min_chars:
        chunks.append(current)
    return chunks


def looks_like_prose(chunk: str) -> bool:
    """Drop tables, hex dumps and changelog noise: mostly letters and spaces, few symbols."""
    letters = sum(c.isalpha() or c.isspace() for c in chunk)
    return letters / len(chunk) > 0.85


def collect_chunks(roots: Sequence[Path], suffixes: tuple[str, ...], prose_only: bool) -> list[str]:
    """Deduplicated chunks from every matching file under the roots."""
    seen: set[str] = set()
    chunks: list[str] = []
    for path in iter_files(roots, suffixes):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for chunk in split_chunks(text):
            key = hashlib.sha1(chunk.encode()).hexdigest()
            if key not in seen and (not prose_only or looks_like_prose(chunk)):
                seen.add(key)
                chunks.append(chunk)
    return chunks
