"""A draft's vocabulary: the tokens its LM head scores (frequency-ranked, as in FR-Spec).

A small draft's LM head is its largest layer: 49k rows × 256 for the embedded draft. The
target's replies use few of those tokens (a few thousand cover nearly all of them), and the
draft is rarely right on the rest, so scoring only them keeps acceptance at a fraction of the
head's cost (measured in docs/ENGINE.md, "The draft's vocabulary"). Output stays exact: the draft only proposes, and the target verifies against its full
vocabulary; a sampled draft's distribution is zero outside the subset, which rejection
sampling accounts for like any other proposal distribution.

The vocabulary lives next to the draft's weights as ``draft_vocab.json``; a draft without one
scores every token.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch

from multiguess.errors import ModelLoadError

FILE = "draft_vocab.json"


def most_frequent(token_counts: Counter[int], size: int) -> list[int]:
    """The ``size`` most frequent token ids, sorted by id (ties broken by id, so it is stable)."""
    ranked = sorted(token_counts.items(), key=lambda item: (-item[1], item[0]))
    return sorted(token for token, _ in ranked[:size])


def count_tokens(sequences: Iterable[Iterable[int]]) -> Counter[int]:
    counts: Counter[int] = Counter()
    for tokens in sequences:
        counts.update(tokens)
    return counts


def write_draft_vocab(folder: Path, token_ids: list[int], source: str) -> Path:
    path = folder / FILE
    path.write_text(json.dumps({"source": source, "size": len(token_ids), "token_ids": token_ids}) + "\n")
    return path


def load_draft_vocab(folder: str, vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary of a local model folder as sorted int64 ids, or None without one."""
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text())["token_ids"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{path}: not a draft vocabulary ({exc})") from exc
    if not ids or not all(isinstance(i, int) for i in ids):
        raise ModelLoadError(f"{path}: token_ids must be a non-empty list of integers")
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= vocab_size:
        raise ModelLoadError(f"{path}: token_ids must be distinct and in [0, {vocab_size})")
    return torch.tensor(sorted(ids), dtype=torch.long)
