"""The step loop: admit, plan, draft, verify, accept, compact, emit (docs/ENGINE.md).

Every running sequence advances by at least one token per step; speculation only adds the
drafted tokens the target agrees with. Plain decoding is the same loop with root-only trees,
so it is also the fallback when the drafter fails. The loop holds the parts together: the
planner plans and drafts each step's trees (``planner.py``), the verifier takes each
sequence's acceptance rule (``verifier.py``), and the slots keep the running sequences in the
caches' lowest slots (``slots.py``).
"""

from __future__ import annotations

import collections
import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from multiguess.engine.admission import next_admission
from multiguess.engine.config import IDLE_PREFILL_CHUNKS, PREFILL_PAUSE_STEPS, EngineConfig
from multiguess.engine.drafter import Proposal
from multiguess.engine.drafters.base import Drafter
from multiguess.engine.grammar import Grammars
from multiguess.engine.guard import fallback_reason
from multiguess.engine.intake import new_sequence
from multiguess.engine.loaded_model import LoadedModel
from multiguess.engine.logprobs import PROMPT_LOGPROB_ROWS, TokenLogprob, prompt_logprobs, step_logprobs
from multiguess.engine.memory_probe import fit_to_memory
from multiguess.engine.padding import padded_groups, prefill_chunks
from multiguess.engine.planner import Outcome, Planner
from multiguess.engine.runner import NativeRunner
from multiguess.engine.sequence import Sequence, SpecStats
from multiguess.engine.slots import Slots
from multiguess.engine.timing import measure_prefill_chunk
from multiguess.engine.tree import TokenTree
from multiguess.engine.verifier import Verdict, accept_trees, record
from multiguess.params import SamplingParams

log = logging.getLogger(__name__)


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


class Engine:
    def __init__(
        self, target: LoadedModel, drafter: Drafter | None = None, config: EngineConfig | None = None
    ) -> None:
        """Serves ``target`` with ``drafter`` (``multiguess.drafting.build_drafter``; None: plain
        decoding): the memory plan counts what the drafter holds, then sizes its caches too."""
        self.config, self.memory_plan = fit_to_memory(
            config or EngineConfig(), target, drafter.memory() if drafter is not None else None
        )
        self.tokenizer = target.tokenizer
        capacity = self.config.max_model_len + self.config.tree_slack
        runner = {
            "backend": self.config.backend,
            "cuda_graphs": self.config.cuda_graphs,
            "kv_blocks": self.config.kv_blocks,
            "graph_width": self.config.graph_width,
        }
        eager = self.config.eager
        self.target = NativeRunner(target, self.config.max_batch, capacity, eager, **runner)
        if drafter is not None:
            drafter.start(self.config.max_batch, capacity, self.config)
        self.drafter = drafter
        self.eos_ids = target.eos_ids
        self.grammars = Grammars(self.tokenizer, self.target.vocab_size, self.eos_ids)
        self.waiting: deque[Sequence] = deque()
        self.waiting_groups: collections.Counter[str] = collections.Counter()  # waiting samples by group
        self.running: list[Sequence] = []
        self.slots = Slots(self.target.cache, self.config.max_batch, self.config.prefix_caching)
        self.totals = SpecStats()
        self.last_draft_error: str | None = None
        self.last_tree_sizes: list[int] = []  # drafted nodes per sequence in the last step
        self.last_outcomes: list[list[Outcome]] = []  # per sequence, the last step's verified levels
        self.fallback_reasons: collections.Counter[str] = collections.Counter()  # steps, by reason
        self.preemptions = 0  # sequences preempted for KV blocks (``_make_room``)
        self.planner = Planner(self.config, self.target, self._decode_without_drafter)
        self.config = self.planner.config  # with the token budget measured on this device
        # The prefill budget of a step in which no sequence decodes: a measured chunk's (auto)
        # several times over, a budget set by hand as it is.
        if self.config.max_prefill_tokens == "auto":
            chunk = measure_prefill_chunk(self.target, self.config.max_model_len, PREFILL_PAUSE_STEPS)
            self.config = replace(self.config, max_prefill_tokens=chunk)
            self.idle_prefill_tokens = IDLE_PREFILL_CHUNKS * chunk
        else:
            self.idle_prefill_tokens = self.config.max_prefill_tokens

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, group: str | None = None
    ) -> Sequence:
        """Queue one sample (``params.n`` is handled by callers, one request per sample). The
        samples of one client request share a ``group`` (default: its own), which admission
        gives fair turns (``engine/admission.py``)."""
        vocab = self.target.vocab_size
        seq = new_sequence(request_id, prompt_ids, params, group, self.config, self.tokenizer, vocab)
        if params.structured_outputs is not None:
            seq.grammar = self.grammars.start(params.structured_outputs, seq.stop_ids(self.eos_ids))
        self.waiting.append(seq)
        self.waiting_groups[seq.group] += 1
        return seq

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
        chunks = self._prefill_work()
        if not self._rides_along(chunks):
            self._prefill(chunks)  # alone: the prompts it completes decode in this step too
            chunks = []
        self.last_tree_sizes, self.last_outcomes = [], []
        batch = [s for s in self.running if not s.prefilling]
        if not batch:
            return []
        proposals = self.planner.propose(batch, self.drafter)  # 2. plan and 3. draft the trees
        width = max(len(p.tree) for p in proposals)  # every row of the forward writes the widest tree
        kept = self._make_room([(s, width) for s in batch])
        batch, proposals = [batch[i] for i in kept], [proposals[i] for i in kept]
        chunks = [(s, n) for s, n in chunks if any(s is r for r in self.running)]
        rows = sum(len(p.tree) for p in proposals) + sum(n for _, n in chunks)
        if chunks and (not batch or rows > self.config.max_model_len):
            self._prefill(chunks)  # more rows than the memory plan measured in one forward
            chunks = []
        if not batch:
            return []
        self.last_tree_sizes = [len(p.tree) - 1 for p in proposals]
        logits, features = self._verify(batch, proposals, chunks)  # 4. verify them in one target forward
        batched = self.target.backend.batched_acceptance
        verdicts = accept_trees(batch, proposals, logits, self.eos_ids, batched)  # 5. accept
        self.target.cache.compact_all(
            [(s.slot, s.cache_len, v.acceptance.path) for s, v in zip(batch, verdicts, strict=True)]
        )
        outputs = []
        for b, (seq, proposal, verdict) in enumerate(zip(batch, proposals, verdicts, strict=True)):
            # 6. compact the caches to the accepted path, 7. emit its tokens
            self._compact(seq, proposal, verdict, None if features is None else features[b])
            for stats in (seq.stats, self.totals):
                record(stats, proposal, verdict.acceptance)
            outputs.append(self._emit(seq, verdict))
        self.last_outcomes = self.planner.learn(batch, proposals, [v.acceptance for v in verdicts])
        # After every sequence's cache is compacted: retiring may move a sequence to another slot.
        for seq in [s for s in batch if s.finished]:
            self._retire(seq)
        return outputs

    def _verify(
        self, batch: list[Sequence], proposals: list[Proposal], chunks: list[tuple[Sequence, int]]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every sequence's tree in one target forward: the logits after each node, and the
        hidden states the drafter reads (None when it reads none). ``chunks`` (prompt chunks
        riding along: ``_rides_along``) are written in the same forward, unscored."""
        capture = self._feature_layers()
        chained = [s for s, _ in chunks]
        started = time.perf_counter()
        verified = self.target.forward_trees(
            [s.slot for s in (*batch, *chained)],
            [s.cache_len for s in (*batch, *chained)],
            [p.tree for p in proposals] + [prompt_chunk(s, n) for s, n in chunks],
            capture=capture,
            unscored=len(chunks),
        )
        if not chunks:  # the curve prices verification alone
            self.planner.timed(batch, proposals, time.perf_counter() - started)
        logits, features = (verified.logits, verified.features) if capture else (verified, None)
        if chunks:
            self._prefilled(chunks, None, None if features is None else features[len(batch) :])
        return logits, features

    def _compact(
        self, seq: Sequence, proposal: Proposal, verdict: Verdict, features: torch.Tensor | None
    ) -> None:
        """Keep the accepted path's cache entries after ``seq``'s prefix in the draft's cache
        (the target's are compacted for the whole batch at once), handing the draft the path's
        features when it reads them."""
        acceptance = verdict.acceptance
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
        """Waiting sequences take the free slots, the lowest first (see ``engine/slots.py``), in fair
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
            if not self.slots.fits(
                [(len(self.running), 0, len(seq.token_ids))], len(self.running), self.drafter
            ):
                return  # its blocks are not free yet: running sequences go first (vLLM's order)
            del self.waiting[index]
            self.waiting_groups[seq.group] -= 1
            seq.slot = len(self.running)
            self.slots.reuse_prefix(seq, self.running, self.drafter)
            self.target.cache.truncate(seq.slot, seq.cache_len)  # a paged cache frees the rest
            self.running.append(seq)

    def _prefill_work(self) -> list[tuple[Sequence, int]]:
        """This step's share of the prompts still being prefilled, as (sequence, tokens):
        ``max_prefill_tokens`` in all (None: every prompt whole; ``idle_prefill_tokens`` while no
        sequence decodes), the earliest admitted first (``prefill_chunks``), each chunk a chain
        after what its sequence has cached. A long prompt is thus prefilled over several steps,
        and the running sequences decode a step between its chunks."""
        pending = [s for s in self.running if s.prefilling]
        decoding = len(pending) < len(self.running)
        budget = self.config.max_prefill_tokens if decoding else self.idle_prefill_tokens
        assert budget is None or isinstance(budget, int)  # "auto" is resolved at construction
        sizes = prefill_chunks([prefill_left(s) for s in pending], budget)
        work = [(s, n) for s, n in zip(pending, sizes, strict=True) if n]
        widest = max((n for _, n in work), default=0)  # a group's rows write its longest chunk
        return [work[i] for i in self._make_room([(s, widest) for s, _ in work])]

    def _rides_along(self, chunks: list[tuple[Sequence, int]]) -> bool:
        """Whether this step's prompt chunks go into the verification forward, unscored, instead
        of a forward of their own: where the backend computes every row alone (a chunk then
        costs its rows, not another pass over the weights), some sequence decodes, and no
        chunk needs its prompt's log-probabilities (every row's logits). A prompt completed
        this way decodes from the next step on."""
        return (
            bool(chunks)
            and self.target.backend.ragged_rows
            and any(not s.prefilling for s in self.running)
            and all(s.params.prompt_logprobs is None for s, _ in chunks)
        )

    def _prefill(self, work: list[tuple[Sequence, int]]) -> None:
        """Prefill ``work``'s chunks in forwards of their own, padded in groups within the rows
        the memory plan measured."""
        capture = self._feature_layers() if work else ()
        rooms = [self.target.capacity - s.cache_len for s, _ in work]
        for group in padded_groups([n for _, n in work], self.config.max_model_len, rooms):
            part = [work[i] for i in group]
            scored = any(s.params.prompt_logprobs is not None for s, _ in part)
            out = self.target.forward_trees(
                [s.slot for s, _ in part],
                [s.cache_len for s, _ in part],
                [prompt_chunk(s, n) for s, n in part],
                last_only=not scored,  # only prompt log-probabilities need every position's logits
                capture=capture,
            )
            logits, features = (out.logits, out.features) if capture else (out, None)
            self._prefilled(part, logits, features)

    def _prefilled(
        self, part: list[tuple[Sequence, int]], logits: torch.Tensor | None, features: torch.Tensor | None
    ) -> None:
        """After ``part``'s chunks are cached: the drafter gets their features (when it reads
        them) and catches up on them, and prompt log-probabilities are taken from ``logits``
        (every chunk row's, where asked)."""
        for b, (seq, n) in enumerate(part):
            start = seq.cache_len
            if features is not None:
                self._hand_features(seq, start, features[b, :n])
            if seq.params.prompt_logprobs is not None and not seq.output_ids:
                assert logits is not None  # such chunks never ride along (``_rides_along``)
                predicted = seq.prompt_ids[start + 1 : start + n + 1]
                seq.prompt_logprobs += prompt_logprobs(logits[b, :n], predicted, seq.params.prompt_logprobs)
            seq.cache_len += n
            self._prefill_draft(seq)

    def _make_room(self, work: list[tuple[Sequence, int]]) -> list[int]:
        """The indices of ``work`` (running sequences, and how many entries each forward row
        writes after its cache) whose writes fit the target's KV cache once running sequences
        are preempted as needed, the most recently admitted (highest slot) first, as vLLM does;
        a static cache always fits."""

        def running() -> list[int]:
            ids = {id(s) for s in self.running}
            return [i for i, (s, _) in enumerate(work) if id(s) in ids]

        def writes() -> list[tuple[int, int, int]]:
            return [(s.slot, s.cache_len, s.cache_len + n) for s, n in (work[i] for i in running())]

        while not self.slots.fits(writes(), len(self.running), self.drafter):
            self._preempt(self.running[-1])
        return running()

    def _preempt(self, seq: Sequence) -> None:
        """vLLM's recompute preemption: ``seq`` (in the highest slot) gives its blocks back and
        waits first in line; once admitted again it prefills its prompt and output (from its own
        blocks where the pool has not reused them yet: they are named by content)."""
        self.running.remove(seq)
        self.slots.evict(seq, self.drafter)
        seq.cache_len = 0
        if not seq.output_ids:  # its prompt's log-probabilities are computed again with it
            seq.prompt_logprobs = []
        self.preemptions += 1
        self.waiting.appendleft(seq)
        self.waiting_groups[seq.group] += 1

    def _prefill_draft(self, seq: Sequence) -> None:
        """The draft catches up on what the target has cached of ``seq``'s prompt (drafters
        that do not ``prefills`` catch up at their first proposal, and those whose prefill is
        optional while the policy drafts no tree: ``Planner.prefills_draft``)."""
        if self.drafter is None or not self.planner.prefills_draft(seq, self.drafter):
            return
        try:
            self.drafter.prefill(seq.slot, seq.token_ids[: seq.cache_len + 1])
        except Exception as exc:  # a failing drafter must never fail a request
            self._decode_without_drafter(exc, [seq])

    def _feature_layers(self) -> tuple[int, ...]:
        """The target layers whose hidden states the drafter reads (EAGLE-3); every target
        forward captures them then, and none otherwise."""
        return self.drafter.feature_layers if self.drafter is not None else ()

    def _hand_features(self, seq: Sequence, position: int, features: torch.Tensor) -> None:
        """The target's features of ``seq`` from ``position`` on, for the drafter's next proposal."""
        assert self.drafter is not None
        try:
            self.drafter.add_features(seq.slot, position, features)
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
        """Take ``seq`` out of the batch and free its slot (``Slots.free``); its output joins
        the recent outputs that copy drafts read."""
        self.running.remove(seq)
        if self.config.prompt_lookup and self.config.recent_outputs:
            self.planner.copies.record(seq.output_ids, seq.params.cache_scope)
        self.slots.free(seq, self.running, self.drafter)


def prompt_chunk(seq: Sequence, tokens: int) -> TokenTree:
    """The next ``tokens`` of ``seq``'s prompt after what its cache holds, as a chain."""
    return TokenTree.chain(seq.token_ids[seq.cache_len : seq.cache_len + tokens])


def prefill_left(seq: Sequence) -> int:
    """Prompt tokens ``seq`` may prefill this step before the step's budget: the rest of its
    prompt, at most ``PROMPT_LOGPROB_ROWS`` when it asks for the prompt's log-probabilities
    (each position's logits are a row over the vocabulary)."""
    left = len(seq.prompt_ids) + len(seq.output_ids) - 1 - seq.cache_len
    return left if seq.params.prompt_logprobs is None else min(left, PROMPT_LOGPROB_ROWS)


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
