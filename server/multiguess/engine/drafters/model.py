"""The ``model`` drafter: a small causal LM grows each tree, one batched draft forward per level.

The tree rules are the grower's (``growing.TreeGrower``). The draft keeps its own KV cache:
the sequence's tokens it has not seen yet are fed as a chain first (usually the root and a
token or two accepted last step), beam nodes are written after them and only the accepted
ones are kept on commit.
"""

from __future__ import annotations

import torch

from multiguess.engine.acceptance import Acceptance
from multiguess.engine.config import EngineConfig
from multiguess.engine.drafter import DraftRequest, Proposal, SampleSpec
from multiguess.engine.drafters.base import Drafter
from multiguess.engine.drafters.growing import Level, TreeGrower
from multiguess.engine.loaded_model import LoadedModel
from multiguess.engine.memory_plan import Footprint
from multiguess.engine.memory_probe import DraftMemory, MemoryMeter, measure_model
from multiguess.engine.padding import padded_groups
from multiguess.engine.prefix_cache import swap_keys
from multiguess.engine.runner import NativeRunner
from multiguess.engine.tree import TokenTree


class ModelDrafter(Drafter):
    """Drafts with ``draft`` (a model sharing the target's tokenizer) over its own KV cache,
    sized by ``start``. ``wire_exact``: see ``TreeGrower`` (a draft server's)."""

    # Its commit keeps the draft KV of the accepted nodes it fed and its next proposal catches
    # up on the rest, so the engine may graft copy drafts onto its trees.
    takes_grafts = True
    # It reads no target features: whatever it has not seen, its next proposal or probe feeds.
    prefills = prefill_optional = True

    def __init__(self, draft: LoadedModel, wire_exact: bool = False) -> None:
        self.draft = draft
        self.wire_exact = wire_exact
        self.cached: dict[int, int] = {}  # slot -> how many of the sequence's tokens are cached
        self._fed: dict[int, tuple[int, dict[int, int]]] = {}  # slot -> (prefix, node -> offset)

    def memory(self) -> DraftMemory:
        """The draft model's weights, and its forwards measured as the target's are (a
        verification of ``max_batch`` trees, a prefill of ``max_model_len``)."""

        def measure(meter: MemoryMeter, config: EngineConfig) -> Footprint:
            return measure_model(self.draft, meter, config, self._vocab(config))

        return DraftMemory(self.draft.device, (self.draft.model,), measure)

    def start(self, slots: int, capacity: int, config: EngineConfig) -> None:
        """The draft's runner and cache; with ``config.draft_vocab`` it scores only the draft's
        vocabulary when it ships one (6x fewer columns for the embedded draft)."""
        self.runner = NativeRunner(
            self.draft,
            slots,
            capacity,
            config.eager,
            self._vocab(config),
            config.backend,
            config.cuda_graphs,
            config.kv_blocks,
            config.graph_width,
        )
        self.grower = TreeGrower(self.runner.head_vocab, self.runner.vocab_size, self.wire_exact)

    def _vocab(self, config: EngineConfig) -> torch.Tensor | None:
        return self.draft.draft_vocab if config.draft_vocab else None

    def release(self, slot: int) -> None:
        self.cached.pop(slot, None)
        self._fed.pop(slot, None)
        self.runner.cache.truncate(slot, 0)

    def retain(self, slot: int, length: int) -> None:
        """Keep the draft cache of the sequence's first ``length`` tokens (those it has seen)."""
        self._fed.pop(slot, None)
        self.cached[slot] = min(self.cached.get(slot, 0), length)
        self.runner.cache.truncate(slot, self.cached[slot])

    def share(self, src: int, dst: int, length: int) -> int:
        """The draft cache of ``src``'s first ``length`` tokens (those it has seen) in ``dst``;
        the catch-up feeds the rest, so the target may skip all ``length``."""
        held = min(self.cached.get(src, 0), length)
        self.release(dst)
        if src != dst:
            self.runner.cache.move(src, dst, held)
        self.cached[dst] = held
        return length

    def move(self, src: int, dst: int) -> None:
        """Carry the sequence's draft cache along (a catch-up from scratch would re-read it all)
        and what ``dst`` retained back to ``src``."""
        self.runner.cache.exchange(src, dst, self.cached.get(src, 0), self.cached.get(dst, 0))
        for state in (self.cached, self._fed):
            swap_keys(state, src, dst)

    def prefill(self, slot: int, token_ids: list[int]) -> None:
        """Feed what the draft has not seen of ``token_ids[:-1]``, the part of a prompt the
        target has just cached (its last token is the target's next one)."""
        start, end = self.cached.get(slot, 0), len(token_ids) - 1
        if start < end:
            self.runner.forward_trees(
                [slot], [start], [TokenTree.chain(token_ids[start:end])], last_only=True
            )
            self.cached[slot] = end

    def behind(self, slot: int, length: int) -> int:
        return max(0, length - self.cached.get(slot, 0))

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        logits, prefixes = self._catch_up(requests)
        grown = self.grower.grow(requests, logits, prefixes, self._feed)
        for req, prefix, g in zip(requests, prefixes, grown, strict=True):
            self._fed[req.slot] = (prefix, g.fed)
        return [g.proposal for g in grown]

    def _catch_up(self, requests: list[DraftRequest]) -> tuple[torch.Tensor, list[int]]:
        """Feed each sequence's tokens the draft has not seen, as a chain: the root's logits
        ``[B, V]``, and where each sequence's tree region starts in the draft's cache."""
        slots = [r.slot for r in requests]
        starts = [self.cached.get(r.slot, 0) for r in requests]
        chunks = [TokenTree.chain(r.token_ids[s:]) for r, s in zip(requests, starts, strict=True)]
        rooms = [self.runner.capacity - s for s in starts]
        groups = padded_groups([len(c) for c in chunks], self.runner.capacity, rooms)  # runs, in order
        parts = [
            self.runner.forward_trees(
                [slots[i] for i in g], [starts[i] for i in g], [chunks[i] for i in g], last_only=True
            )
            for g in groups
        ]
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)  # one run, the usual step: no copy
        prefixes = [len(r.token_ids) for r in requests]
        for r, n in zip(requests, prefixes, strict=True):
            self.cached[r.slot] = n
        return logits, prefixes

    def _feed(self, level: Level) -> list[torch.Tensor]:
        """One draft forward over every sequence's beam; returns each beam's logits rows."""
        tokens, depths, used, visible = level.place()
        lens = torch.tensor(level.prefixes)[:, None]
        slots = [r.slot for r in level.requests]
        logits = self.runner.forward(slots, level.prefixes, tokens, lens + depths, lens[:, 0] + used, visible)
        return [logits[b, : len(beam)] for b, beam in enumerate(level.beams)]

    def observe(
        self, slot: int, token_ids: list[int], width: int, since: int, sample: SampleSpec | None = None
    ) -> list[int | None]:
        """Catch the draft's cache up on ``token_ids`` and rank each known token from ``since``
        on among the draft's ``width`` guesses at its position: for a greedy or seeded
        sequence's output, whether a node with ``width`` children there would have held the
        target's token (a prompt's tokens say little about that). It costs one draft forward
        over the catch-up that drafting would make anyway, and nothing on the target."""
        start = self.cached.get(slot, 0)
        if start >= len(token_ids):
            return []
        first = max(start + 1, since)  # the first token ranked
        self.prefill(slot, token_ids[:first])  # what comes before its guess, without logits
        start = first - 1  # row i of the rest guesses token first + i
        logits = self.runner.forward_trees([slot], [start], [TokenTree.chain(token_ids[start:])])[0]
        self.cached[slot] = len(token_ids)
        return self.grower.ranks(logits[: len(token_ids) - first], token_ids, first, width, sample)

    def commit(self, slot: int, proposal: Proposal, acceptance: Acceptance) -> None:
        """Keep the draft KV of accepted nodes that were fed to the draft (a prefix of the path)."""
        prefix, offsets = self._fed.pop(slot, (self.cached.get(slot, 0), {}))
        kept = []
        for node in acceptance.path[1:]:
            if node not in offsets:
                break
            kept.append(offsets[node])
        self.runner.cache.compact(slot, prefix, kept)
        self.cached[slot] = prefix + len(kept)
