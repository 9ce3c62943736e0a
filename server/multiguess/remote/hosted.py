"""What a draft server hosts: a drafter and the model name and tokenizer it announces."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiguess.engine.drafters.eagle3 import Eagle3Drafter
    from multiguess.engine.drafters.model import ModelDrafter


@dataclass(frozen=True)
class Hosted:
    """A drafter a draft server hosts (the server sizes it with ``start``; ``wire_exact``), and
    the model name and tokenizer it announces (a head announces its target's tokenizer)."""

    drafter: ModelDrafter | Eagle3Drafter
    name: str
    tokenizer: Any
