"""The drafter base: the calls the engine makes, and each drafter's abilities as data.

The interface is three calls: ``propose`` a tree per sequence, ``commit`` what the target
accepted (so a stateful drafter can keep its cache in step), ``release`` a sequence's state;
``move`` follows a sequence to another slot, and ``observe`` measures the drafter against tokens
the target already chose, where it can do that without a tree; ``behind`` says how much of a
sequence it has yet to see, which is what probing that sequence costs it. For prefix reuse
(``engine/prefix_cache.py``) a finished sequence is ``retain``-ed instead of released, and a
new sequence starts with ``share``: from what a slot holds of its first tokens.
A drafter that raises never fails a request: the engine decodes that step with the target
alone and calls ``release`` so the drafter starts that sequence afresh.

What a drafter can do beyond that is declared, not probed for:

- ``feature_layers``: the target layers whose hidden states it reads (EAGLE-3). The engine then
  has its target forwards capture them and hands them over with ``add_features(slot, position,
  features)``: the prompt's after prefill, the accepted path's after every verification.
- ``takes_grafts``: the engine may graft copy drafts (``engine/suffix.py``) onto its greedy and
  seeded trees after the drafter's own (``Proposal.drafted``); ``copy_only``: it is not asked
  for trees at all, its trees are those grafts (the suffix drafter).
- ``prefills``: it catches up on a prompt while the target prefills it (``prefill``), chunk by
  chunk under ``EngineConfig.max_prefill_tokens``; others catch up at their first proposal.
  ``prefill_optional``: it can also catch up alone, at its next proposal or probe, so the
  engine skips its ``prefill`` while the policy drafts no tree (``Planner.prefills_draft``):
  traffic where drafting does not pay does not pay for the draft's prefill either.
- ``degraded`` and ``reason``: readiness (``GuardedDrafter`` pauses a failing drafter).
- ``memory``: what it holds on a device, which the engine's memory plan counts before ``start``
  sizes its caches to the planned sequences.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from multiguess.engine.acceptance import Acceptance
from multiguess.engine.drafter import DraftRequest, Proposal, SampleSpec

if TYPE_CHECKING:
    from multiguess.engine.config import EngineConfig
    from multiguess.engine.memory_probe import DraftMemory


class Drafter(ABC):
    """A drafter: the calls the engine makes, and its abilities (class attributes, and
    ``feature_layers``, which depends on what a drafter loaded or connected to)."""

    takes_grafts: bool = False
    copy_only: bool = False
    prefills: bool = False
    prefill_optional: bool = False
    degraded: bool = False
    reason: str | None = None

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers (transformers' ``output_hidden_states`` index) it reads: none."""
        return ()

    def memory(self) -> DraftMemory | None:
        """What it holds on a device (None: nothing)."""
        return None

    def start(self, slots: int, capacity: int, config: EngineConfig) -> None:  # noqa: B027 (optional)
        """Size what it keeps per sequence: ``slots`` sequences of ``capacity`` tokens (the
        engine's planned batch and cache length). Nothing to size by default."""

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]: ...

    @abstractmethod
    def commit(self, slot: int, proposal: Proposal, acceptance: Acceptance) -> None: ...

    @abstractmethod
    def release(self, slot: int) -> None: ...

    @abstractmethod
    def retain(self, slot: int, length: int) -> None:
        """The sequence in ``slot`` finished: keep what the drafter holds of its first ``length``
        tokens for a later sequence that starts with them (``share``); 0 is ``release``."""

    @abstractmethod
    def share(self, src: int, dst: int, length: int) -> int:
        """A new sequence in ``dst`` starts with the first ``length`` tokens of the sequence held
        in ``src`` (running or retained; ``dst`` itself: in place): take what the drafter holds
        of them, drop the rest of ``dst``'s state, and return how many of those tokens the
        target may skip computing (at most ``length``; fewer when the drafter needs the
        target's forward over some of them, as EAGLE-3 needs their features)."""

    @abstractmethod
    def move(self, src: int, dst: int) -> None:
        """The sequence in slot ``src`` now runs in the free slot ``dst``, and what ``dst``
        retained is retained in ``src`` now (the two slots swap)."""

    @abstractmethod
    def observe(
        self, slot: int, token_ids: list[int], width: int, since: int, sample: SampleSpec | None = None
    ) -> list[int | None] | None:
        """The rank of each ``token_ids[i]``, ``i >= since``, whose guess the drafter had not made
        yet (it had not seen ``token_ids[i - 1]``) among its ``width`` best guesses there (None:
        not among them), in order; None when the drafter cannot tell without drafting a tree.
        ``sample``: a seeded sample's, whose guesses are its race's winners (``coupled``)."""

    def prefill(self, slot: int, token_ids: list[int]) -> None:
        """Catch up on ``token_ids[:-1]``, the part of a prompt the target has just cached (its
        last token is the target's next one). Called only when ``prefills`` is true."""
        raise NotImplementedError(f"{type(self).__name__} does not prefill")

    def behind(self, slot: int, length: int) -> int:
        """How many of the first ``length`` tokens of the sequence in ``slot`` it has not seen:
        what its next proposal or probe of it feeds first. 0 here: it keeps nothing per sequence."""
        return 0

    def add_features(self, slot: int, position: int, features: torch.Tensor) -> None:
        """The target's hidden states ``[m, F]`` at ``feature_layers`` of the sequence in
        ``slot``, positions ``position..position + m - 1``. Called only when it reads some."""
        raise NotImplementedError(f"{type(self).__name__} reads no target features")


class StatelessDrafter(Drafter):
    """A drafter that keeps nothing per sequence (it proposes from the sequence's own text):
    the calls about sequence state do nothing, and subclasses write ``propose`` alone."""

    def commit(self, slot: int, proposal: Proposal, acceptance: Acceptance) -> None:
        """Nothing to keep."""

    def release(self, slot: int) -> None:
        """Nothing to free."""

    def retain(self, slot: int, length: int) -> None:
        """Nothing to keep."""

    def share(self, src: int, dst: int, length: int) -> int:
        """Nothing to share: the target may skip every shared token."""
        return length

    def move(self, src: int, dst: int) -> None:
        """Nothing to move."""

    def observe(
        self, slot: int, token_ids: list[int], width: int, since: int, sample: SampleSpec | None = None
    ) -> None:
        """None, it cannot tell: what it would have guessed depends on where the text repeated
        itself, so probe trees (or the engine's copy policy) measure it."""


class WrappedDrafter(Drafter):
    """A drafter around another (a guard, a fault injector, a timer): every call and ability
    is the inner drafter's; subclasses override what they change."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.takes_grafts, self.copy_only, self.prefills = inner.takes_grafts, inner.copy_only, inner.prefills
        self.prefill_optional = inner.prefill_optional

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.inner.feature_layers

    def memory(self) -> DraftMemory | None:
        return self.inner.memory()

    def start(self, slots: int, capacity: int, config: EngineConfig) -> None:
        self.inner.start(slots, capacity, config)

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        return self.inner.propose(requests)

    def commit(self, slot: int, proposal: Proposal, acceptance: Acceptance) -> None:
        self.inner.commit(slot, proposal, acceptance)

    def release(self, slot: int) -> None:
        self.inner.release(slot)

    def retain(self, slot: int, length: int) -> None:
        self.inner.retain(slot, length)

    def share(self, src: int, dst: int, length: int) -> int:
        return self.inner.share(src, dst, length)

    def move(self, src: int, dst: int) -> None:
        self.inner.move(src, dst)

    def observe(
        self, slot: int, token_ids: list[int], width: int, since: int, sample: SampleSpec | None = None
    ) -> list[int | None] | None:
        return self.inner.observe(slot, token_ids, width, since, sample)

    def prefill(self, slot: int, token_ids: list[int]) -> None:
        self.inner.prefill(slot, token_ids)

    def behind(self, slot: int, length: int) -> int:
        return self.inner.behind(slot, length)

    def add_features(self, slot: int, position: int, features: torch.Tensor) -> None:
        self.inner.add_features(slot, position, features)
