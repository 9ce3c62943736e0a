"""The step loop: admit requests, draft trees, verify them in one target forward, accept.

Every running sequence advances by at least one token per step; speculation only adds the
drafted tokens the target agrees with. Plain decoding is the same loop with root-only trees,
so it is also the fallback when the drafter fails.
"""

from __future__ import annotations

import collections
import logging
import random
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from multiguess.engine.acceptance import Acceptance
from multiguess.engine.adaptive import Outcome
from multiguess.engine.admission import next_admission
from multiguess.engine.config import PREFILL_PAUSE_STEPS, EngineConfig
from multiguess.engine.drafter import Drafter, ModelDrafter, Proposal
from multiguess.engine.grammar import Grammars
from multiguess.engine.guard import fallback_reason
from multiguess.engine.loaded_model import LoadedModel
from multiguess.engine.logprobs import TokenLogprob, prompt_logprobs, step_logprobs
from multiguess.engine.memory_probe import fit_to_memory
from multiguess.engine.padding import padded_groups, prefill_chunks
from multiguess.engine.planner import Planner
from multiguess.engine.prefix_cache import PrefixIndex, plan_reuse
from multiguess.engine.runner import NativeRunner
from multiguess.engine.sampling import Generators
from multiguess.engine.sequence import Sequence, SpecStats
from multiguess.engine.timing import measure_prefill_chunk
from multiguess.engine.tree import TokenTree
from multiguess.engine.verifier import Verdict, accept_trees, record
from multiguess.errors import InvalidRequestError
from multiguess.params import SamplingParams

log = logging.getLogger(__name__)

# Prompt positions whose log-probabilities one forward computes at most (a [rows, V] tensor),
# chunked prefill or not: prompt log-probabilities take bounded memory.
PROMPT_LOGPROB_ROWS = 256


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    sequence: Sequence
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens whose text is out
    prompt_logprobs: list[TokenLogprob] | None = None  # with the first output, when asked


def check_prompt_ids(prompt_ids: list[int], vocab: int) -> None:
    """Refuse token ids the target has no embedding for (they would index past its tables)."""
    if prompt_ids and (min(prompt_ids) < 0 or max(prompt_ids) >= vocab):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")


class Engine:
    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None = None,
        config: EngineConfig | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        self.config, self.memory_plan = fit_to_memory(
            config or EngineConfig(), target, draft if drafter is None else None
        )
        self.tokenizer = target.tokenizer
        capacity = self.config.max_model_len + self.config.tree_slack
        runner = {"backend": self.config.backend, "cuda_graphs": self.config.cuda_graphs}
        eager = self.config.eager
        self.target = NativeRunner(target, self.config.max_batch, capacity, eager, **runner)
        if drafter is None and draft is not None:
            vocab = draft.draft_vocab if self.config.draft_vocab else None
            drafter = ModelDrafter(
                NativeRunner(draft, self.config.max_batch, capacity, eager, vocab, **runner)
            )
        self.drafter = drafter
        self.eos_ids = frozenset(eos_token_ids(target))
        self.grammars = Grammars(self.tokenizer, self.target.vocab_size, self.eos_ids)
        self.waiting: deque[Sequence] = deque()
        self.waiting_groups: collections.Counter[str] = collections.Counter()  # waiting samples by group
        self.running: list[Sequence] = []
        self.prefixes = PrefixIndex()  # what the free slots keep of finished sequences
        self.totals = SpecStats()
        self.last_draft_error: str | None = None
        self.last_tree_sizes: list[int] = []  # drafted nodes per sequence in the last step
        self.last_outcomes: list[list[Outcome]] = []  # per sequence, the last step's verified levels
        self.fallback_reasons: collections.Counter[str] = collections.Counter()  # steps, by reason
        self.planner = Planner(self.config, self.target, self._decode_without_drafter)
        self.config = self.planner.config  # with the token budget measured on this device
        if self.config.max_prefill_tokens == "auto":
            chunk = measure_prefill_chunk(self.target, self.config.max_model_len, PREFILL_PAUSE_STEPS)
            self.config = replace(self.config, max_prefill_tokens=chunk)

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, group: str | None = None
    ) -> Sequence:
        """Queue one sample (``params.n`` is handled by callers, one request per sample). The
        samples of one client request share a ``group`` (default: its own), which admission
        gives fair turns (``engine/admission.py``)."""
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        limit = self.config.max_model_len
        if len(prompt_ids) + params.max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context length of {limit} tokens"
            )
        cfg = self.config
        if (params.num_candidates or 0) > cfg.num_candidates or (params.depth or 0) > cfg.depth:
            raise InvalidRequestError(
                f"num_candidates and depth may be at most the server's ({cfg.num_candidates}, {cfg.depth})"
            )
        vocab = self.target.vocab_size
        check_prompt_ids(prompt_ids, vocab)
        if any(not 0 <= token < vocab for token, _ in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})")
        if any(not 0 <= token < vocab for token in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab})")
        generators = None
        if not params.greedy:
            generators = Generators(params.seed if params.seed is not None else random.getrandbits(63))
        seq = Sequence(request_id, list(prompt_ids), params, generators, group=group or request_id)
        seq.prediction = self._prediction_ids(params)
        if params.structured_outputs is not None:
            seq.grammar = self.grammars.start(params.structured_outputs, seq.stop_ids(self.eos_ids))
        self.waiting.append(seq)
        self.waiting_groups[seq.group] += 1
        return seq

    def _prediction_ids(self, params: SamplingParams) -> np.ndarray | None:
        """The request's predicted output as token ids (None: none or empty); a prediction
        longer than the context is refused, since no reply could follow it."""
        if params.prediction is None:
            return None
        predicted = params.prediction
        if isinstance(predicted, str):
            predicted = self.tokenizer.encode(predicted, add_special_tokens=False)
        limit = self.config.max_model_len
        if len(predicted) > limit:
            raise InvalidRequestError(
                f"the prediction ({len(predicted)} tokens) is longer than the context length of {limit} tokens"
            )
        vocab = self.target.vocab_size
        if any(not 0 <= token < vocab for token in predicted):
            raise InvalidRequestError(f"prediction token ids must be in [0, {vocab})")
        return np.asarray(predicted, dtype=np.int64) if predicted else None

    def abort(self, request_id: str) -> None:
        self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
        self.waiting_groups = collections.Counter(s.group for s in self.waiting)
        for seq in [s for s in self.running if s.request_id == request_id]:
            self._retire(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One step of every running sequence, as docs/ENGINE.md ("Data flow: one step") tells it."""
        self._admit()  # 1. admit waiting requests, then prefill their prompts
        self._prefill()
        self.last_tree_sizes, self.last_outcomes = [], []
        batch = [s for s in self.running if not s.prefilling]
        if not batch:
            return []
        proposals = self.planner.propose(batch, self.drafter)  # 2. plan and 3. draft the trees
        self.last_tree_sizes = [len(p.tree) - 1 for p in proposals]
        logits, features = self._verify(batch, proposals)  # 4. verify them in one target forward
        verdicts = accept_trees(batch, proposals, logits, self.eos_ids)  # 5. accept
        outputs = []
        for b, (seq, proposal, verdict) in enumerate(zip(batch, proposals, verdicts, strict=True)):
            # 6. compact the caches to the accepted path, 7. emit its tokens
            self._compact(seq, proposal, verdict.acceptance, None if features is None else features[b])
            for stats in (seq.stats, self.totals):
                record(stats, proposal, verdict.acceptance)
            outputs.append(self._emit(seq, verdict))
        self.last_outcomes = self.planner.learn(batch, proposals, [v.acceptance for v in verdicts])
        # After every sequence's cache is compacted: retiring may move a sequence to another slot.
        for seq in [s for s in batch if s.finished]:
            self._retire(seq)
        return outputs

    def _verify(
        self, batch: list[Sequence], proposals: list[Proposal]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every sequence's tree in one target forward: the logits after each node, and the
        hidden states the drafter reads (None when it reads none)."""
        capture = self._feature_layers()
        verified = self.target.forward_trees(
            [s.slot for s in batch],
            [s.cache_len for s in batch],
            [p.tree for p in proposals],
            capture=capture,
        )
        return (verified.logits, verified.features) if capture else (verified, None)

    def _compact(
        self, seq: Sequence, proposal: Proposal, acceptance: Acceptance, features: torch.Tensor | None
    ) -> None:
        """Keep the accepted path's cache entries after ``seq``'s prefix, the target's and the
        draft's (the draft is handed the path's features when it reads them)."""
        self.target.cache.compact(seq.slot, seq.cache_len, acceptance.path)
        if features is not None:
            self._hand_features(seq, seq.cache_len, features[acceptance.path])
        seq.cache_len += len(acceptance.path)
        if self.drafter is not None and len(proposal.tree) > 1:
            self.drafter.commit(seq.slot, proposal, acceptance)

    def _emit(self, seq: Sequence, verdict: Verdict) -> StepOutput:
        """Append the accepted tokens to ``seq``; the step's output is what is new of it."""
        acceptance = verdict.acceptance
        before = len(seq.output_ids)
        logprobs = step_logprobs(
            seq.params.logprobs, acceptance.path, acceptance.tokens, verdict.rows, verdict.probs
        )
        seq.append(acceptance.tokens, self.eos_ids, self.tokenizer, logprobs)
        delta = seq.take_text_delta()
        return StepOutput(
            seq.request_id,
            seq.output_ids[before:],
            delta,
            seq.finished,
            seq.finish_reason,
            seq,
            seq.take_logprobs(self.tokenizer),
            seq.prompt_logprobs if before == 0 and seq.params.prompt_logprobs is not None else None,
        )

    def _admit(self) -> None:
        """Waiting sequences take the free slots, the lowest first (see ``_retire``), in fair
        turns between requests (``admission.next_admission``), each starting from the longest
        prefix the caches hold of its prompt; ``_prefill`` computes the rest of the prompt.
        A sample whose request has a running sample of the same prompt still prefilling waits
        for it (``Twins``): an ``n`` > 1 request prefills its prompt once."""
        share = self.config.request_slots
        while self.waiting and len(self.running) < self.config.max_batch:
            held = collections.Counter(s.group for s in self.running)
            open_groups = {g for g, n in self.waiting_groups.items() if n and held[g] < share}
            if not open_groups:
                return
            twins = {(r.group, tuple(r.prompt_ids)) for r in self.running if r.prefilling}
            blocked = Twins(self.waiting, twins)
            groups = (s.group for s in self.waiting)  # lazily: the scan stops early
            index = next_admission(groups, held, share, blocked, len(open_groups))
            if index is None:
                return
            seq = self.waiting[index]
            del self.waiting[index]
            self.waiting_groups[seq.group] -= 1
            seq.slot = len(self.running)
            self._reuse_prefix(seq, self.running)
            self.running.append(seq)

    def _prefill(self) -> None:
        """This step's share of the prompts still being prefilled: ``max_prefill_tokens`` in all
        (None: every prompt whole), the earliest admitted first (``prefill_chunks``), each chunk
        a chain after what its sequence has cached. A long prompt is thus prefilled over several
        steps, and the running sequences decode a step between its chunks. The draft catches up
        on each chunk too, so the first proposal does not feed the whole prompt in one step."""
        pending = [s for s in self.running if s.prefilling]
        budget = self.config.max_prefill_tokens
        assert budget is None or isinstance(budget, int)  # "auto" is resolved at construction
        sizes = prefill_chunks([prefill_left(s) for s in pending], budget)
        work = [(s, n) for s, n in zip(pending, sizes, strict=True) if n]
        capture = self._feature_layers() if work else ()
        rooms = [self.target.capacity - s.cache_len for s, _ in work]
        for group in padded_groups([n for _, n in work], self.config.max_model_len, rooms):
            part = [work[i] for i in group]
            scored = any(s.params.prompt_logprobs is not None for s, _ in part)
            out = self.target.forward_trees(
                [s.slot for s, _ in part],
                [s.cache_len for s, _ in part],
                [TokenTree.chain(s.prompt_ids[s.cache_len : s.cache_len + n]) for s, n in part],
                last_only=not scored,  # only prompt log-probabilities need every position's logits
                capture=capture,
            )
            logits = out.logits if capture else out
            for b, (seq, n) in enumerate(part):
                start = seq.cache_len
                if capture:
                    self._hand_features(seq, start, out.features[b, :n])
                if seq.params.prompt_logprobs is not None:
                    predicted = seq.prompt_ids[start + 1 : start + n + 1]
                    seq.prompt_logprobs += prompt_logprobs(
                        logits[b, :n], predicted, seq.params.prompt_logprobs
                    )
                seq.cache_len += n
                self._prefill_draft(seq)

    def _prefill_draft(self, seq: Sequence) -> None:
        """The draft catches up on what the target has cached of ``seq``'s prompt (drafters
        without ``prefill`` catch up at their first proposal)."""
        prefill = getattr(self.drafter, "prefill", None)
        if prefill is None:
            return
        try:
            prefill(seq.slot, seq.prompt_ids[: seq.cache_len + 1])
        except Exception as exc:  # a failing drafter must never fail a request
            self._decode_without_drafter(exc, [seq])

    def _reuse_prefix(self, seq: Sequence, others: list[Sequence]) -> None:
        """Bring the longest prefix of ``seq``'s prompt that a kept or running sequence holds
        into ``seq``'s new slot, target and draft (``prefix_cache.plan_reuse``); its cache
        then starts after it."""
        if not self.config.prefix_caching:
            return
        slot, scope = seq.slot, seq.params.cache_scope
        running = {s.slot: (s.params.cache_scope, s.token_ids[: s.cache_len]) for s in others}
        # A request for its prompt's log-probabilities computes the whole prompt (reused KV has
        # no logits): it matches nothing, and the slot's kept entry is handled as on a miss.
        prompt = seq.prompt_ids if seq.params.prompt_logprobs is None else seq.prompt_ids[:1]
        free = range(slot, self.config.max_batch)
        plan = plan_reuse(prompt, slot, free, running, self.prefixes, scope)
        if plan.swap_with is not None:
            incoming = plan.length if plan.copy_from is None else 0  # a victim's entry is not needed
            self.target.cache.exchange(slot, plan.swap_with, len(self.prefixes.kept(slot)), incoming)
            self.prefixes.swap(slot, plan.swap_with)
            if self.drafter is not None:
                self.drafter.move(plan.swap_with, slot)
        self.prefixes.drop(slot)
        reused = plan.length
        if self.drafter is not None:
            reused = self.drafter.share(plan.source, slot, plan.length)
        if plan.copy_from is not None:
            self.target.cache.move(plan.copy_from, slot, reused)
        seq.cache_len = seq.cached_tokens = reused

    def _feature_layers(self) -> tuple[int, ...]:
        """The target layers whose hidden states the drafter reads (EAGLE-3); every target
        forward captures them then, and none otherwise."""
        return tuple(getattr(self.drafter, "feature_layers", ())) if self.drafter is not None else ()

    def _hand_features(self, seq: Sequence, position: int, features: torch.Tensor) -> None:
        """The target's features of ``seq`` from ``position`` on, for the drafter's next proposal."""
        assert self.drafter is not None
        try:
            self.drafter.add_features(seq.slot, position, features)  # type: ignore[attr-defined]
        except Exception as exc:  # a failing drafter must never fail a request
            self._decode_without_drafter(exc, [seq])

    def _decode_without_drafter(self, exc: Exception, seqs: list[Sequence]) -> None:
        """This step decodes ``seqs`` plainly; the drafter starts them afresh next time."""
        assert self.drafter is not None
        log.warning("drafter failed, decoding this step without it: %s", exc)
        self.last_draft_error = f"{type(exc).__name__}: {exc}"
        for seq in seqs:
            self.drafter.release(seq.slot)
            seq.stats.fallback_steps += 1
            self.totals.fallback_steps += 1
        self.fallback_reasons[fallback_reason(exc)] += len(seqs)

    def _retire(self, seq: Sequence) -> None:
        """Free ``seq``'s slot, moving the sequence in the highest slot into it.

        Running sequences thus always hold slots ``0..n-1`` in order, which the caches read as
        one view; scattered slots would be gathered (copied) in every layer of every step. A
        move copies one sequence's committed entries once, in the draft's cache too. With
        prefix caching the freed slot keeps ``seq``'s tokens and KV, and a move swaps them into
        the slot the moved sequence leaves."""
        self.running.remove(seq)
        if self.config.prompt_lookup and self.config.recent_outputs:
            self.planner.copies.record(seq.output_ids, seq.params.cache_scope)
        kept = seq.token_ids[: seq.cache_len] if self.config.prefix_caching else []
        self.prefixes.keep(seq.slot, kept, seq.params.cache_scope)
        if self.drafter is not None:
            self.drafter.retain(seq.slot, len(kept))
        last = max(self.running, key=lambda s: s.slot, default=None)
        if last is not None and last.slot > seq.slot:
            self.target.cache.exchange(last.slot, seq.slot, last.cache_len, len(kept))
            self.prefixes.swap(last.slot, seq.slot)
            if self.drafter is not None:
                self.drafter.move(last.slot, seq.slot)
            last.slot = seq.slot
            self.running.sort(key=lambda s: s.slot)


def prefill_left(seq: Sequence) -> int:
    """Prompt tokens ``seq`` may prefill this step before the step's budget: the rest of its
    prompt, at most ``PROMPT_LOGPROB_ROWS`` when it asks for the prompt's log-probabilities
    (each position's logits are a row over the vocabulary)."""
    left = len(seq.prompt_ids) - 1 - seq.cache_len
    return left if seq.params.prompt_logprobs is None else min(left, PROMPT_LOGPROB_ROWS)


def eos_token_ids(model: LoadedModel) -> set[int]:
    ids = set()
    for source in (
        model.tokenizer.eos_token_id,
        getattr(model.model.generation_config, "eos_token_id", None),
    ):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids


class Twins:
    """The waiting samples (by index) whose request has a running sample of the same prompt
    still prefilling: they start from its KV once it is cached (prefix caching) instead of
    computing the prompt too. Looked up only for the entries admission examines."""

    def __init__(self, waiting: deque[Sequence], prefilling: set[tuple[str, tuple[int, ...]]]) -> None:
        self.waiting, self.prefilling = waiting, prefilling
        self.groups = {group for group, _ in prefilling}

    def __contains__(self, index: object) -> bool:
        seq = self.waiting[index]  # type: ignore[index]
        return seq.group in self.groups and (seq.group, tuple(seq.prompt_ids)) in self.prefilling
