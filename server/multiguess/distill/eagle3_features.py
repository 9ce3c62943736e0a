"""What an EAGLE-3 head learns from: the target's hidden states at every position of its records.

The data stage (``dataset.py``) already records the target's replies and its top-k at every
labelled position. This stage adds, for every record of every data shard, the hidden states
entering the head's feature layers (low, middle, high; ``[n, 3 * hidden]`` in bf16) from one
teacher-forced pass of the target, into a features shard of the same name. Shards are written
atomically and skipped when present, so the stage resumes like the others.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from multiguess.distill.teacher import Record

KINDS = ("heldout", "gen", "text")


@torch.inference_mode()
def record_features(
    model, records: Sequence[Record], layers: Sequence[int], pad_id: int
) -> list[torch.Tensor]:
    """``[len(ids), len(layers) * hidden]`` bf16 features of each record (one batched forward)."""
    width = max(len(r.ids) for r in records)
    ids = torch.full((len(records), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(records), width), dtype=torch.long)
    for i, r in enumerate(records):
        ids[i, : len(r.ids)] = r.ids.long()
        mask[i, : len(r.ids)] = 1
    out = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    fused = torch.cat([out.hidden_states[i] for i in layers], dim=-1).to(torch.bfloat16)
    return [fused[i, : len(r.ids)].clone() for i, r in enumerate(records)]


def read_shard(path: Path) -> list[Record]:
    return [Record(*fields) for fields in torch.load(path, weights_only=True)]


def features_path(folder: Path, shard: Path) -> Path:
    return folder / shard.name


def write_features(path: Path, features: list[torch.Tensor]) -> None:
    """Via a temp file and a rename: a features shard is complete or absent."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(features, tmp)
    os.replace(tmp, path)


def run_features_job(
    model, data: Path, folder: Path, layers: Sequence[int], pad_id: int, batch: int = 8
) -> int:
    """Fill ``folder`` with the features of every shard in ``data``; returns how many it wrote."""
    written = 0
    for kind in KINDS:
        for shard in sorted(data.glob(f"{kind}-*.pt")):
            path = features_path(folder, shard)
            if path.exists():
                continue
            records = read_shard(shard)
            ordered = sorted(range(len(records)), key=lambda i: len(records[i].ids))
            features: list[torch.Tensor | None] = [None] * len(records)
            for start in range(0, len(ordered), batch):
                chunk = ordered[start : start + batch]
                for i, f in zip(
                    chunk, record_features(model, [records[i] for i in chunk], layers, pad_id), strict=True
                ):
                    features[i] = f
            write_features(path, features)  # type: ignore[arg-type]
            written += 1
            print(f"distill eagle3: features of {shard.name}", file=sys.stderr, flush=True)
    return written


def read_features(data: Path, folder: Path, kind: str) -> tuple[list[Record], list[torch.Tensor]]:
    """The records of ``kind`` whose shards have features, with their features, in shard order."""
    records: list[Record] = []
    features: list[torch.Tensor] = []
    for shard in sorted(data.glob(f"{kind}-*.pt")):
        path = features_path(folder, shard)
        if not path.exists():
            continue
        shard_records = read_shard(shard)
        shard_features = torch.load(path, weights_only=True)
        if len(shard_features) != len(shard_records):
            raise ValueError(f"{path} holds {len(shard_features)} features for {len(shard_records)} records")
        records += shard_records
        features += shard_features
    return records, features
