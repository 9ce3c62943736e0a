"""The ``suffix`` drafter: copy drafts alone, no model (``engine/suffix.py``)."""

from __future__ import annotations

from multiguess.engine.drafter import DraftRequest, Proposal
from multiguess.engine.drafters.base import StatelessDrafter
from multiguess.engine.tree import TokenTree


class SuffixDrafter(StatelessDrafter):
    """The ``suffix`` drafter: no model; every tree is the engine's copy draft (``CopySource``
    over the sequence and recent outputs), sized by the engine's copy policy (``copy_only``:
    the engine does not ask it for trees). It keeps no state, so its calls do nothing."""

    copy_only = True
    takes_grafts = True

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """Nothing of its own: root-only trees, which the engine's copy drafts graft onto."""
        return [Proposal(TokenTree.chain([r.token_ids[-1]])) for r in requests]
