"""Drafters sized for a test on their own, outside an engine (which sizes them itself)."""

from __future__ import annotations

from multiguess.engine.config import EngineConfig
from multiguess.engine.drafters.eagle3 import Eagle3Drafter
from multiguess.engine.drafters.model import ModelDrafter
from multiguess.engine.eagle3_head import Eagle3Head
from multiguess.engine.loaded_model import LoadedModel
from torch import nn

# Every column scored, as a runner without a draft vocabulary scores them.
ALL_COLUMNS = EngineConfig(draft_vocab=False)
# The head's linears as they train (plain products), so its forwards compare with training's.
PLAIN = EngineConfig(eager=True)


def model_drafter(model: LoadedModel, slots: int, capacity: int, wire_exact: bool = False) -> ModelDrafter:
    drafter = ModelDrafter(model, wire_exact)
    drafter.start(slots, capacity, ALL_COLUMNS)
    return drafter


def eagle3_drafter(head: Eagle3Head, embed: nn.Module, slots: int, capacity: int) -> Eagle3Drafter:
    drafter = Eagle3Drafter(head, embed)
    drafter.start(slots, capacity, PLAIN)
    return drafter
