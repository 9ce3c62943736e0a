"""An EAGLE-3 head loaded away from its target, for a draft server (``serve-draft --drafter eagle3``).

The head reads the target's features (they arrive over the network) and, unless it ships its
own, the target's token embeddings. So the draft server reads of the target only what it needs:
its config (to refuse a head made for another target), its tokenizer (to announce the
tokenizer's fingerprint) and the one tensor of its token embeddings, out of the target's
safetensors files (a head with its own embeddings skips that too). The target's other weights
are never read.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import cached_file

from multiguess.engine.eagle3_head import Eagle3Head
from multiguess.errors import ModelLoadError
from multiguess.models.eagle3_checkpoint import load_head
from multiguess.models.loading import check_architecture, resolve_device, resolve_dtype

log = logging.getLogger(__name__)

EMBEDDING = "model.embed_tokens.weight"  # every supported family's name for it
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


@dataclass
class LoadedHead:
    head: Eagle3Head
    embed: nn.Module  # the head's own token embeddings, or the target's
    tokenizer: PreTrainedTokenizerBase  # the target's
    name: str  # the head's folder
    device: torch.device
    dtype: torch.dtype


def embedding_file(target: str) -> str:
    """The safetensors file of ``target`` (a folder or a hub id) that holds its token embeddings."""
    index = cached_file(target, INDEX, _raise_exceptions_for_missing_entries=False)
    if index is not None:
        try:
            shard = json.loads(Path(index).read_text())["weight_map"][EMBEDDING]
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"{target}: {INDEX} names no shard for {EMBEDDING}") from exc
        found = cached_file(target, shard, _raise_exceptions_for_missing_entries=False)
    else:
        found = cached_file(target, SINGLE, _raise_exceptions_for_missing_entries=False)
    if found is None:
        raise ModelLoadError(f"{target}: no safetensors weights to read the token embeddings from")
    return found


def read_embedding(target: str) -> torch.Tensor:
    """The target's token embedding matrix ``[vocab, hidden]``, and nothing else of its weights."""
    from safetensors import safe_open

    path = embedding_file(target)
    with safe_open(path, framework="pt") as weights:
        if EMBEDDING not in weights.keys():  # noqa: SIM118  (safe_open is not a mapping)
            raise ModelLoadError(f"{path} holds no {EMBEDDING}")
        return weights.get_tensor(EMBEDDING)


def load_draft_head(head: str, target: str, dtype: str = "auto", device: str = "auto") -> LoadedHead:
    """The EAGLE-3 head in the folder ``head`` for ``target`` (a folder or a hub id)."""
    device = resolve_device(device)
    try:
        config = AutoConfig.from_pretrained(target)
        tokenizer = AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the target {target!r}: {exc}") from exc
    check_architecture(config, target)
    torch_dtype = resolve_dtype(dtype, device)
    loaded, own = load_head(head, config, torch_dtype, device)
    if own is None:
        weight = read_embedding(target)
        if weight.shape != (config.vocab_size, config.hidden_size):
            raise ModelLoadError(
                f"{target}: {EMBEDDING} has shape {tuple(weight.shape)}, its config implies "
                f"{(config.vocab_size, config.hidden_size)}"
            )
        own = nn.Embedding.from_pretrained(weight.to(device, torch_dtype), freeze=True)
    log.info("loaded the EAGLE-3 head %s for %s (%s)", head, target, torch_dtype)
    return LoadedHead(loaded, own, tokenizer, head, torch.device(device), torch_dtype)
