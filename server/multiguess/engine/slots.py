"""The batch's cache slots: which sequence holds which, in the target's cache and the draft's,
and what the free slots keep of finished sequences (prefix caching).

Running sequences always hold slots ``0..n-1`` in order, which the caches read as one view;
scattered slots would be gathered (copied) in every layer of every step. So a retiring
sequence's slot takes the sequence in the highest slot (``free``), and a new one takes the
lowest free slot, starting from the longest prefix of its prompt that a slot holds
(``reuse_prefix``).
"""

from __future__ import annotations

from multiguess.engine.drafters.base import Drafter
from multiguess.engine.kv_cache import KVCache
from multiguess.engine.prefix_cache import PrefixIndex, plan_reuse
from multiguess.engine.sequence import Sequence


class Slots:
    def __init__(self, cache: KVCache, max_batch: int, prefix_caching: bool) -> None:
        self.cache = cache  # the target's
        self.max_batch = max_batch
        self.prefix_caching = prefix_caching
        self.prefixes = PrefixIndex()  # what the free slots keep of finished sequences

    def reuse_prefix(self, seq: Sequence, others: list[Sequence], drafter: Drafter | None) -> None:
        """Bring the longest prefix of ``seq``'s prompt that a kept or running sequence holds
        into ``seq``'s new slot, target and draft (``prefix_cache.plan_reuse``); its cache
        then starts after it."""
        if not self.prefix_caching:
            return
        slot, scope = seq.slot, seq.params.cache_scope
        running = {s.slot: (s.params.cache_scope, s.token_ids[: s.cache_len]) for s in others}
        # A request for its prompt's log-probabilities computes the whole prompt (reused KV has
        # no logits): it matches nothing, and the slot's kept entry is handled as on a miss.
        prompt = seq.token_ids if seq.params.prompt_logprobs is None else seq.prompt_ids[:1]
        free = range(slot, self.max_batch)
        plan = plan_reuse(prompt, slot, free, running, self.prefixes, scope)
        if plan.swap_with is not None:
            incoming = plan.length if plan.copy_from is None else 0  # a victim's entry is not needed
            self.cache.exchange(slot, plan.swap_with, len(self.prefixes.kept(slot)), incoming)
            self.prefixes.swap(slot, plan.swap_with)
            if drafter is not None:
                drafter.move(plan.swap_with, slot)
        self.prefixes.drop(slot)
        reused = plan.length
        if drafter is not None:
            reused = drafter.share(plan.source, slot, plan.length)
        if plan.copy_from is not None:
            self.cache.move(plan.copy_from, slot, reused)
        # A paged cache may still hold more of the prompt in blocks no slot keeps.
        reused = self.cache.recall(slot, prompt[: len(prompt) - 1], scope, reused)
        seq.cache_len = reused
        if not seq.output_ids:  # a preempted sequence's reuse is not its prompt's
            seq.cached_tokens = reused

    def free(self, seq: Sequence, running: list[Sequence], drafter: Drafter | None) -> None:
        """Free the slot of ``seq`` (no longer in ``running``), moving the sequence in the
        highest slot into it. A move copies one sequence's committed entries once, in the
        draft's cache too. With prefix caching the freed slot keeps ``seq``'s tokens and KV,
        and a move swaps them into the slot the moved sequence leaves."""
        kept = self._remember(seq)
        self.prefixes.keep(seq.slot, kept, seq.params.cache_scope)
        self.cache.truncate(seq.slot, len(kept))
        if drafter is not None:
            drafter.retain(seq.slot, len(kept))
        last = max(running, key=lambda s: s.slot, default=None)
        if last is not None and last.slot > seq.slot:
            self.cache.exchange(last.slot, seq.slot, last.cache_len, len(kept))
            self.prefixes.swap(last.slot, seq.slot)
            if drafter is not None:
                drafter.move(last.slot, seq.slot)
            last.slot = seq.slot
            running.sort(key=lambda s: s.slot)

    def fits(self, writes: list[tuple[int, int, int]], running: int, drafter: Drafter | None) -> bool:
        """Whether the target's cache can make ``writes`` (``KVCache.fits``), once the free
        slots (from ``running`` on) have given their kept prefixes' blocks back if it takes
        that (a paged cache keeps their full blocks findable by content until it reuses them)."""
        if self.cache.fits(writes):
            return True
        for slot in range(running, self.max_batch):
            self._empty(slot, drafter)
        return self.cache.fits(writes)

    def evict(self, seq: Sequence, drafter: Drafter | None) -> None:
        """Give back every block of a preempted ``seq``'s slot; its full blocks stay findable by
        content, so its prompt and output may be found again when it is admitted again."""
        self._remember(seq)
        self._empty(seq.slot, drafter)

    def _remember(self, seq: Sequence) -> list[int]:
        """The tokens of ``seq``'s cache that are kept for reuse (none without prefix caching),
        named by content in the cache."""
        kept = seq.token_ids[: seq.cache_len] if self.prefix_caching else []
        self.cache.remember(seq.slot, kept, seq.params.cache_scope)
        return kept

    def _empty(self, slot: int, drafter: Drafter | None) -> None:
        """``slot`` keeps nothing: no prefix, no blocks, no draft state."""
        self.prefixes.drop(slot)
        self.cache.truncate(slot, 0)
        if drafter is not None:
            drafter.release(slot)
