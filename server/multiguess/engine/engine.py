"""The step loop: admit requests, draft trees, verify them in one target forward, accept.

Every running sequence advances by at least one token per step; speculation only adds the
drafted tokens the target agrees with. Plain decoding is the same loop with root-only trees,
so it is also the fallback when the drafter fails.
"""

from __future__ import annotations

import collections
import itertools
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from multiguess.engine.acceptance import Acceptance, SeededChoices, accept_greedy, accept_sampled
from multiguess.engine.adaptive import (
    CopyYield,
    CostMeter,
    ForwardCost,
    Outcome,
    ProbeSchedule,
    copy_width,
    expected_tokens,
    graft_outcome,
    level_outcomes,
)
from multiguess.engine.admission import next_admission
from multiguess.engine.config import PREFILL_PAUSE_STEPS, EngineConfig
from multiguess.engine.drafter import Drafter, DraftRequest, ModelDrafter, Proposal, SampleSpec, TreeBudget
from multiguess.engine.grammar import Grammars
from multiguess.engine.guard import fallback_reason
from multiguess.engine.loaded_model import LoadedModel
from multiguess.engine.logprobs import TokenLogprob, prompt_logprobs, step_logprobs
from multiguess.engine.memory_probe import fit_to_memory
from multiguess.engine.ngram import graft
from multiguess.engine.padding import padded_groups, prefill_chunks
from multiguess.engine.penalties import node_logits
from multiguess.engine.prediction import Alignment, prediction_draft
from multiguess.engine.prefix_cache import PrefixIndex, plan_reuse
from multiguess.engine.runner import NativeRunner
from multiguess.engine.sampling import Generators, NodeDistributions, Processing
from multiguess.engine.sequence import Sequence, SpecStats
from multiguess.engine.sources import better_copy, copy_worth, model_drafts, model_worth
from multiguess.engine.suffix import CopyDraft, CopySource, RecentOutputs
from multiguess.engine.tree import TokenTree
from multiguess.errors import InvalidRequestError
from multiguess.params import SamplingParams

log = logging.getLogger(__name__)

MIN_PREFILL_CHUNK = 64  # a smaller chunk would pay a whole weight read for a few tokens
MAX_PREFILL_CHUNK = 8192
# Prompt positions whose log-probabilities one forward computes at most (a [rows, V] tensor),
# chunked prefill or not: prompt log-probabilities take bounded memory.
PROMPT_LOGPROB_ROWS = 256


def measure_forward_cost(
    runner: NativeRunner, limit: int, rounds: int = 5, context: int = 256
) -> ForwardCost:
    """The target's forward time for 1, 2, 4, … ``limit`` tokens, as one chain on slot 0 after
    ``context`` cached tokens, before any request runs (admission overwrites it). A batch of
    single tokens costs about the same as a chain of as many: both are one matmul over that
    many rows, and attention over as many rows of context.

    The context matters: without it attention is free, trees are priced below what they cost,
    and the policy drafts trees that lose. The sizes take turns for ``rounds`` rounds and each
    keeps its fastest time, so a burst of load on a shared machine hits one sample, not one
    size (timing each size back to back misordered sizes and planned trees smaller than they
    pay); the curve is then made non-decreasing (more tokens never cost less). The measurements
    behind both choices are in docs/ENGINE.md."""
    counts = sorted({min(2**i, limit) for i in range(limit.bit_length() + 1)})
    context = cache_context(runner, context, limit)
    best = dict.fromkeys(counts, float("inf"))
    for _ in range(rounds):
        for count in counts:
            best[count] = min(best[count], time_chain(runner, context, count))
    seconds = list(itertools.accumulate((best[c] for c in counts), max))
    log.info(
        "target forward ms by tokens after %d cached: %s",
        context,
        {c: round(s * 1000, 2) for c, s in zip(counts, seconds, strict=True)},
    )
    return ForwardCost(tuple(counts), tuple(seconds))


def cache_context(runner: NativeRunner, context: int, limit: int) -> int:
    """Fill slot 0 with ``context`` tokens (at most what leaves room for ``limit`` more), so
    timed forwards attend over a cached context as real ones do; returns its length."""
    context = max(0, min(context, runner.capacity - limit))
    if context:
        runner.forward_trees([0], [0], [TokenTree.chain([0] * context)], last_only=True)
    return context


def time_chain(runner: NativeRunner, context: int, count: int, last_only: bool = False) -> float:
    """Seconds of one target forward of a chain of ``count`` tokens after ``context`` on slot 0
    (``last_only``: the last position's logits only, as a prefill chunk computes)."""
    start = time.perf_counter()
    runner.forward_trees([0], [context], [TokenTree.chain([0] * count)], last_only=last_only)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - start


def measure_prefill_chunk(
    runner: NativeRunner,
    limit: int,
    pause_steps: float = PREFILL_PAUSE_STEPS,
    rounds: int = 5,
    context: int = 256,
) -> int:
    """The chunk ``max_prefill_tokens="auto"`` prefills per step: the largest power of two
    (at least ``MIN_PREFILL_CHUNK``, at most ``limit``) whose forward after ``context`` cached
    tokens takes at most ``pause_steps`` one-token forwards. Each of ``rounds`` rounds times
    one token, then doubling chains until one is too slow by the fastest times so far: a burst
    of load on a shared machine slows one round's sample, not the answer, and the measurement
    costs a few chunks' time. On a CPU, where forward time grows with the tokens almost at
    once, this is a chunk of about a hundred tokens; on a GPU, whose forwards cost the same up
    to hundreds of tokens, thousands."""
    limit = max(1, min(limit, MAX_PREFILL_CHUNK))
    smallest = min(MIN_PREFILL_CHUNK, limit)
    context = cache_context(runner, context, limit)
    best: dict[int, float] = collections.defaultdict(lambda: float("inf"))

    def fits(count: int) -> bool:
        best[count] = min(best[count], time_chain(runner, context, count, last_only=True))
        return best[count] <= pause_steps * best[1]

    for _ in range(rounds):
        fits(1)
        count = smallest * 2
        while count <= limit and fits(count):
            count *= 2
    chunk = max((c for c in best if c > smallest and best[c] <= pause_steps * best[1]), default=smallest)
    log.info("prefill chunk: %d tokens (a forward within %.1f ms)", chunk, pause_steps * best[1] * 1000)
    return chunk


@dataclass(frozen=True)
class Copy:
    """A sequence's copy draft this step, whether it follows its prediction, and its worth in
    tokens per plain step verified alone (``sources.copy_worth``)."""

    draft: CopyDraft
    predicted: bool
    worth: float


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
        self.costs = CostMeter()
        # The draft's coverage by width on this traffic, for greedy (True) and sampled requests
        # apart: the policy's prior until anything was drafted, then running rates over every
        # verified tree, so a new request does not spend its first steps on an optimistic guess.
        policy = self.config.policy
        self.coverage = dict.fromkeys(
            (True, False), policy.initial(self.config.num_candidates, self.config.depth)
        )
        self.probes = ProbeSchedule(policy.probe_every)
        # Measured whatever the drafter: a server attaches a remote drafter after construction.
        self.forward_cost = ForwardCost()
        if self.config.adaptive:
            limit = max(policy.token_budget, self.config.max_batch, self.target.backend.cost_tokens)
            self.forward_cost = measure_forward_cost(self.target, min(limit, self.target.capacity))
            budget = self.forward_cost.nearly_free(policy.nearly_free)
            if budget > policy.token_budget:  # measured on this device: more nodes ride for free
                self.config = replace(self.config, policy=replace(policy, token_budget=budget))
        if self.config.max_prefill_tokens == "auto":
            chunk = measure_prefill_chunk(self.target, self.config.max_model_len, PREFILL_PAUSE_STEPS)
            self.config = replace(self.config, max_prefill_tokens=chunk)
        self.steps = 0
        self.copies = CopySource(RecentOutputs(self.config.recent_outputs, self.config.recent_age))
        self.prediction_yields = CopyYield()  # how predictions pay, apart from copies

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
        predicted = self._prediction_ids(params)
        seq.prediction = None if predicted is None else Alignment(predicted)
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
        self._admit()
        self._prefill()
        self.last_tree_sizes, self.last_outcomes = [], []
        batch = [s for s in self.running if not s.prefilling]
        if not batch:
            return []
        self.steps += 1
        started = time.perf_counter()
        proposals = self._propose(batch)
        drafted = time.perf_counter()
        self.last_tree_sizes = [len(p.tree) - 1 for p in proposals]
        self.last_outcomes = []
        capture = self._feature_layers()
        verified = self.target.forward_trees(
            [s.slot for s in batch],
            [s.cache_len for s in batch],
            [p.tree for p in proposals],
            capture=capture,
        )
        logits, features = (verified.logits, verified.features) if capture else (verified, None)
        # Draft time per level only from steps that drafted on caught-up caches (see CostMeter).
        drafting = [s for s, p in zip(batch, proposals, strict=True) if p.own_nodes > 1]
        steady = all(s.drafted_at == self.steps - 1 for s in drafting)
        levels = max(p.drafted_depth for p in proposals) if steady else 0
        self.costs.record(drafted - started, levels)
        for seq in drafting:
            seq.drafted_at = self.steps
        outputs: list[StepOutput] = []
        observed: dict[bool, list[list[Outcome]]] = {True: [], False: []}
        rows = [
            node_logits(seq, p.tree, logits[b], self.eos_ids)
            for b, (seq, p) in enumerate(zip(batch, proposals, strict=True))
        ]
        target_probs = target_distributions(batch, rows)
        for b, (seq, proposal) in enumerate(zip(batch, proposals, strict=True)):
            if seq.params.greedy:
                acceptance = accept_greedy(proposal.tree, rows[b].argmax(dim=-1).tolist())
            elif seq.params.seed is not None:  # the seed alone fixes its output: verified like greedy
                choices = SeededChoices(target_probs[b], proposal.tree, seq.params.seed, len(seq.token_ids))
                acceptance = accept_greedy(proposal.tree, choices)
            else:
                acceptance = accept_sampled(
                    proposal.tree, target_probs[b], proposal.draft_probs, seq.generators.on(logits.device)
                )
            self.target.cache.compact(seq.slot, seq.cache_len, acceptance.path)
            if features is not None:
                self._hand_features(seq, seq.cache_len, features[b, acceptance.path])
            seq.cache_len += len(acceptance.path)
            if self.drafter is not None and len(proposal.tree) > 1:
                self.drafter.commit(seq.slot, proposal, acceptance)
            self._record(seq, proposal, acceptance)
            self.last_outcomes.append(level_outcomes(*proposal.drafted_part(acceptance.path)))
            observed[seq.params.greedy].append(self.last_outcomes[-1])
            before = len(seq.output_ids)
            logprobs = step_logprobs(
                seq.params.logprobs, acceptance.path, acceptance.tokens, rows[b], target_probs.get(b)
            )
            seq.append(acceptance.tokens, self.eos_ids, self.tokenizer, logprobs)
            delta = seq.take_text_delta()
            outputs.append(
                StepOutput(
                    seq.request_id,
                    seq.output_ids[before:],
                    delta,
                    seq.finished,
                    seq.finish_reason,
                    seq,
                    seq.take_logprobs(self.tokenizer),
                    seq.prompt_logprobs if before == 0 and seq.params.prompt_logprobs is not None else None,
                )
            )
        for greedy, outcomes in observed.items():
            self.coverage[greedy] = self.config.policy.update(self.coverage[greedy], outcomes)
        # After every sequence's cache is compacted: retiring may move a sequence to another slot.
        for seq in [s for s in batch if s.finished]:
            self._retire(seq)
        return outputs

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

    def _planned(self, batch: list[Sequence]) -> list[TreeBudget]:
        """The adaptive policy's tree for each sequence of ``batch`` this step.

        One tree serves the whole batch: trees are padded to the widest in the batch, and one
        deep tree would make every sequence pay for its width and its draft forwards. While no
        tree pays, the sequence observed longest ago probes when the schedule says so."""
        cfg, cost = self.config, self.forward_cost
        if not cfg.adaptive:
            return [cfg.budget] * len(batch)
        fixed, per_level = self.costs.ratios(cost(len(batch)))
        coverages = [self.coverage[s.params.greedy] for s in batch]
        planned = cfg.policy.plan(cfg.budget, coverages, per_level, cost, fixed)
        trees = [planned] * len(batch)
        if planned.depth > 0:
            self.probes.reset()
        elif self.probes.due(cfg.policy.probe_interval(len(batch))):
            adaptive = [i for i, seq in enumerate(batch) if not fixed_tree(seq.params)]
            if adaptive:
                oldest = min(adaptive, key=lambda i: batch[i].drafted_at)
                if not self._observe(batch[oldest]):
                    trees[oldest] = cfg.policy.probe(cfg.budget, len(batch))
        return trees

    def _observe(self, seq: Sequence) -> bool:
        """Probe a greedy or seeded sequence without a tree: rank the tokens the target chose
        since the draft last saw the sequence among the draft's guesses (``Drafter.observe``; a
        seeded sample's guesses are its race's winners). A probe tree pads every sequence of the
        batch to its width in the target's forward (docs/ENGINE.md); this costs one draft
        forward over the catch-up that drafting would make anyway.
        False when the drafter cannot (an unseeded sample's children are draws, not ranks)."""
        assert self.drafter is not None
        if not seq.params.greedy and seq.params.seed is None:
            return False
        width = self.config.num_candidates
        try:
            ranks = self.drafter.observe(
                seq.slot, seq.token_ids, width, len(seq.prompt_ids), sample_spec(seq)
            )
        except Exception as exc:  # a failing drafter must never fail a request
            self._decode_without_drafter(exc, [seq])
            return True
        if ranks is None:
            return False
        observed = [[(width, rank)] for rank in ranks]  # each a first-level guess
        greedy = seq.params.greedy
        self.coverage[greedy] = self.config.policy.update(self.coverage[greedy], observed)
        seq.drafted_at = self.steps
        return True

    def _budget(self, seq: Sequence, planned: TreeBudget) -> TreeBudget:
        """This step's tree for ``seq``: the ``planned`` one, or the request's own override,
        clipped to what is left."""
        cfg, params = self.config, seq.params
        budget = planned
        if fixed_tree(params):
            budget = TreeBudget(
                params.num_candidates or cfg.num_candidates,
                cfg.depth if params.depth is None else params.depth,
                cfg.max_nodes,
            )
        return replace(budget, depth=max(0, min(budget.depth, self._room(seq))))

    def _room(self, seq: Sequence) -> int:
        """Levels a tree of ``seq`` may reach below its root: the tokens it may still produce
        and the context has room for, less the bonus token."""
        return min(seq.remaining, self.config.max_model_len - len(seq.prompt_ids) - len(seq.output_ids)) - 1

    def _propose(self, batch: list[Sequence]) -> list[Proposal]:
        proposals = [Proposal(TokenTree.chain([s.last_token])) for s in batch]
        base = [1.0] * len(batch)  # tokens each sequence's tree is expected to yield
        copies = self._copy_drafts(batch)
        if self.drafter is not None and not getattr(self.drafter, "copy_only", False):
            self._draft(batch, proposals, base, copies)
        self._graft_copies(batch, proposals, base, copies)
        return proposals

    def _draft(
        self, batch: list[Sequence], proposals: list[Proposal], base: list[float], copies: dict[int, Copy]
    ) -> None:
        """The drafter's trees for the sequences the policy gives one, into ``proposals``, and
        the tokens each is expected to yield into ``base``. A sequence whose copy draft is worth
        at least its tree drafts none (``sources.model_drafts``)."""
        assert self.drafter is not None
        cfg, cost = self.config, self.forward_cost
        requests = []
        planned = self._planned(batch)
        fixed, per_level = self.costs.ratios(cost(len(batch)))
        for i, seq in enumerate(batch):
            budget = self._budget(seq, planned[i])
            if budget.depth == 0:
                continue
            tokens = expected_tokens(self.coverage[seq.params.greedy], budget)
            if cfg.adaptive and not fixed_tree(seq.params) and i in copies:
                worth = model_worth(
                    tokens, budget.max_nodes, budget.depth, cost, len(batch), fixed, per_level
                )
                if not model_drafts(copies[i].worth, worth):
                    continue
            base[i] = tokens
            requests.append((i, DraftRequest(seq.slot, seq.token_ids, budget, sample_spec(seq), seq.grammar)))
        if not requests:
            return
        try:
            drafted = self.drafter.propose([r for _, r in requests])
        except Exception as exc:  # a failing drafter must never fail a request
            self._decode_without_drafter(exc, [batch[i] for i, _ in requests])
            for i, _ in requests:
                base[i] = 1.0
            return
        for (i, _), proposal in zip(requests, drafted, strict=True):
            proposals[i] = proposal

    def _copy_drafts(self, batch: list[Sequence]) -> dict[int, Copy]:
        """Each sequence's copy draft, by index in ``batch``: of its prediction's continuation
        where it aligns with the output (``engine/prediction.py``) and the continuation of its
        suffix where it occurred before, in its text or in recent outputs (``CopySource``; with a
        drafter that takes grafts, and not under a grammar), the one worth more
        (``sources.copy_worth``). None for a request that chose its own tree."""
        cfg = self.config
        if not cfg.prompt_lookup:
            return {}
        copying = getattr(self.drafter, "takes_grafts", False)
        limit, found = 1 + cfg.prompt_lookup, {}
        for i, seq in enumerate(batch):
            if fixed_tree(seq.params):
                continue
            room = min(cfg.prompt_lookup, self._room(seq))
            drafts = [(self._predicted(seq, room), True)]
            if copying and seq.grammar is None:
                scope = seq.params.cache_scope
                seq.own_text.sync(seq.prompt_ids, seq.output_ids)
                drafts.append((self.copies.draft(seq.own_text, room, cfg.prompt_lookup, scope), False))
            drafts = [(d, predicted) for d, predicted in drafts if d is not None and len(d.tree) > 1]
            worths = [copy_worth(d.reach, self.forward_cost, len(batch), limit) for d, _ in drafts]
            best = better_copy(worths)
            if best is not None:
                found[i] = Copy(drafts[best][0], drafts[best][1], worths[best])
        return found

    def _graft_copies(
        self, batch: list[Sequence], proposals: list[Proposal], base: list[float], copies: dict[int, Copy]
    ) -> None:
        """Graft each sequence's copy draft (``_copy_drafts``) onto its tree, drafted or not.
        Where a reply repeats text (code edits, quotes, extraction, an agent's tool calls) it
        goes on far past where a draft's guesses fade, and costs microseconds. The forward pads
        every tree to the widest, so grafts fill that padding for free and widen the batch only
        while their expected tokens pay for the wider forward (``adaptive.copy_width`` over the
        measured ``ForwardCost``, against what each tree is expected to yield: ``base``), which
        they never do where matches are short and rarely accepted. Not onto sampled children
        (exact sampling needs the distribution each was drawn from; greedy and seeded
        acceptance hold for any tree, and an unseeded sample's tree of copies alone is
        deterministic); under a grammar, only a prediction's chain, cut where the grammar stops
        allowing it."""
        cfg = self.config
        drafts: dict[int, tuple[TokenTree, tuple[float, ...], int, bool]] = {}
        for i, copy in copies.items():
            seq, proposal = batch[i], proposals[i]
            if seq.params.greedy or seq.params.seed is not None or not proposal.draft_probs:
                grafted, reach = graft(proposal.tree, copy.draft.tree, copy.draft.reach, cfg.prompt_lookup)
                drafts[i] = grafted, reach, copy.draft.match, copy.predicted
        if not drafts:
            return
        own = [len(p.tree) for p in proposals]
        reach = [drafts[i][1] if i in drafts else () for i in range(len(batch))]
        width = copy_width(own, base, reach, self.forward_cost, 1 + cfg.prompt_lookup)
        for i, (tree, _, match, predicted) in drafts.items():
            keep = min(len(tree) - own[i], max(0, width - own[i]))
            if keep:
                trimmed = TokenTree(tree.tokens[: own[i] + keep], tree.parents[: own[i] + keep])
                proposals[i] = replace(
                    proposals[i], tree=trimmed, drafted=own[i], copy_match=match, predicted=predicted
                )
            else:
                (self.prediction_yields if predicted else self.copies.yields).relax(match)

    def _predicted(self, seq: Sequence, room: int) -> CopyDraft | None:
        """``seq``'s prediction's chain after its output (``prediction.prediction_draft``), cut
        to what its grammar allows; None without a prediction or where none aligns."""
        if seq.prediction is None:
            return None
        seq.prediction.sync(seq.output_ids)
        draft = prediction_draft(seq.last_token, seq.prediction, room, self.prediction_yields)
        if draft is None:
            return None
        if seq.grammar is not None:
            allowed = seq.grammar.valid_prefix(list(draft.tree.tokens[1:]))
            draft = replace(
                draft, tree=TokenTree.chain(draft.tree.tokens[: 1 + allowed]), reach=draft.reach[:allowed]
            )
        return draft

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

    def _record(self, seq: Sequence, proposal: Proposal, acceptance: Acceptance) -> None:
        """Count the step in the request's and the engine's stats, and a grafted copy draft's
        outcome in the copy policy's yields."""
        grafted = len(proposal.tree) - proposal.own_nodes
        copied = sum(node >= proposal.own_nodes for node in acceptance.path)
        copy_source = "prediction" if proposal.predicted else "copy"
        for stats in (seq.stats, self.totals):
            stats.verify_steps += 1
            stats.draft_tokens += len(proposal.tree) - 1
            stats.accepted_tokens += acceptance.accepted_drafts
            stats.count("model", proposal.own_nodes - 1, acceptance.accepted_drafts - copied)
            stats.count(copy_source, grafted, copied)
        if proposal.copy_match:
            tried, accepted = graft_outcome(proposal.tree, proposal.own_nodes, acceptance.path)
            yields = self.prediction_yields if proposal.predicted else self.copies.yields
            yields.observe(proposal.copy_match, tried, accepted)

    def _retire(self, seq: Sequence) -> None:
        """Free ``seq``'s slot, moving the sequence in the highest slot into it.

        Running sequences thus always hold slots ``0..n-1`` in order, which the caches read as
        one view; scattered slots would be gathered (copied) in every layer of every step. A
        move copies one sequence's committed entries once, in the draft's cache too. With
        prefix caching the freed slot keeps ``seq``'s tokens and KV, and a move swaps them into
        the slot the moved sequence leaves."""
        self.running.remove(seq)
        if self.config.prompt_lookup and self.config.recent_outputs:
            self.copies.record(seq.output_ids, seq.params.cache_scope)
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


def fixed_tree(params: SamplingParams) -> bool:
    """Whether a request drafts its own fixed tree instead of the policy's: it set one. A
    seeded sample follows the policy too: its output does not depend on the trees drafted
    (``acceptance.SeededChoices``), so timing and batch neighbours cannot change it."""
    return params.depth is not None or params.num_candidates is not None


def processing(params: SamplingParams) -> Processing:
    return Processing(params.temperature, params.top_p, params.top_k)


def sample_spec(seq: Sequence) -> SampleSpec | None:
    """Sampled requests draw their children from the draft (seeded ones take the draft's best
    under the noise their target draws with); greedy ones take its top-k."""
    if seq.params.greedy:
        return None
    return SampleSpec(processing(seq.params), seq.generators, coupled=seq.params.seed is not None)


def target_distributions(batch: list[Sequence], rows: list[torch.Tensor]) -> dict[int, NodeDistributions]:
    """The processed target distribution at every tree node of the sampled sequences, from
    each sequence's (adjusted) logits after each of its nodes, processed as acceptance reads them."""
    return {
        b: NodeDistributions(rows[b], processing(seq.params))
        for b, seq in enumerate(batch)
        if not seq.params.greedy
    }


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
