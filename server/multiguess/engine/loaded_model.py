"""What the engine runs: a model with its tokenizer, device and dtype, however it was loaded
(``models/loading.py`` loads checkpoints into it). Kept beside the engine, so that the engine
depends on this record and not on the loaders above it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    name: str
    device: torch.device
    dtype: torch.dtype  # activation dtype the runner feeds the model
    draft_vocab: torch.Tensor | None = None  # the tokens its head scores as a draft (draft_vocab.py)

    @property
    def eos_ids(self) -> frozenset[int]:
        """The tokens that end a sequence: the tokenizer's and the generation config's."""
        ids: set[int] = set()
        for source in (
            self.tokenizer.eos_token_id,
            getattr(self.model.generation_config, "eos_token_id", None),
        ):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        return frozenset(ids)
