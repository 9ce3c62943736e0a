"""Teacher records on disk: numbered shards written atomically, so a stopped job resumes cleanly.

A shard's index fixes its content (the batches are a deterministic list), so resuming means
skipping the indices whose files already exist.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import torch
from multiguess.distill.teacher import Record

T = TypeVar("T")


def shard_path(folder: Path, prefix: str, index: int) -> Path:
    return folder / f"{prefix}-{index:05d}.pt"


def write_shard(path: Path, records: Sequence[Record]) -> None:
    """Save via a temp file and rename: a shard is either complete or absent."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = [(r.ids, r.start, r.topk_ids, r.topk_logprobs) for r in records]
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def read_shards(folder: Path, prefix: str) -> list[Record]:
    """Every record in the folder's shards with this prefix, in shard order."""
    records = []
    for path in sorted(folder.glob(f"{prefix}-*.pt")):
        records += [Record(*fields) for fields in torch.load(path, weights_only=True)]
    return records


def fill_shards(
    folder: Path,
    prefix: str,
    batches: Sequence[T],
    produce: Callable[[T], list[Record]],
    deadline: float | None = None,
) -> Iterator[int]:
    """Produce the missing shards in order, yielding each index done.

    Stops at ``deadline`` (monotonic), but never before shard 0 exists: an empty kind is useless.
    """
    for index, batch in enumerate(batches):
        if deadline is not None and index > 0 and time.monotonic() > deadline:
            return
        path = shard_path(folder, prefix, index)
        if not path.exists():
            write_shard(path, produce(batch))
        yield index
