"""Steps 2 and 3 of the loop: plan each sequence's tree, have the drafter draft it, graft copies.

The planner holds the policy's state: the draft's measured coverage (greedy and sampled
requests apart), the target's forward-cost curve, the draft's time per level, the probe
schedule, and how copy and prediction drafts pay. It reads them to decide each step's trees
(``adaptive.AdaptivePolicy``) and learns from every verified step. A failing drafter never
fails a request: the engine's ``fallback`` decodes the sequences it failed for plainly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from multiguess.engine.acceptance import Acceptance
from multiguess.engine.adaptive import (
    COPY_CHECKS_LONGEST,
    CopyYield,
    CostMeter,
    ForwardCost,
    Outcome,
    ProbeSchedule,
    copies_may_widen,
    copy_width,
    expected_tokens,
    graft_outcome,
    level_outcomes,
)
from multiguess.engine.config import EngineConfig
from multiguess.engine.drafter import DraftRequest, Proposal, SampleSpec, TreeBudget
from multiguess.engine.drafters.base import Drafter
from multiguess.engine.forward_times import ForwardTimes
from multiguess.engine.ngram import graft
from multiguess.engine.prediction import prediction_draft, prediction_prospect
from multiguess.engine.runner import NativeRunner
from multiguess.engine.sequence import Sequence
from multiguess.engine.sources import better_copy, copy_worth, model_drafts, model_worth
from multiguess.engine.suffix import CopyDraft, CopySource, Match, RecentOutputs
from multiguess.engine.timing import measure_forward_cost
from multiguess.engine.tree import TokenTree
from multiguess.params import SamplingParams

# What the engine does with sequences whose drafter call failed: decode them plainly this step.
Fallback = Callable[[Exception, list[Sequence]], None]


@dataclass(frozen=True)
class Candidate:
    """A sequence that may get a copy draft this step (``Planner._copy_drafts``): its index in
    the batch, the levels it may draft, where its prediction aligns with its output and its
    longest earlier matches (None and empty where it has none)."""

    index: int
    seq: Sequence
    room: int
    aligned: Match | None
    best: list[Match]


@dataclass(frozen=True)
class Copy:
    """A sequence's copy draft this step, whether it follows its prediction, and its worth in
    tokens per plain step verified alone (``sources.copy_worth``)."""

    draft: CopyDraft
    predicted: bool
    worth: float


class Planner:
    """The policy's state and each step's trees. ``config`` comes back with the token budget
    the target's measured forward times allow (``ForwardCost.nearly_free``)."""

    def __init__(self, config: EngineConfig, target: NativeRunner, fallback: Fallback) -> None:
        self.config = config
        self.fallback = fallback
        self.steps = 0  # steps proposed for; a sequence's ``drafted_at`` counts in them
        self.drafting = True  # whether the latest plan drafted trees (``prefills_draft``)
        self.costs = CostMeter()
        # The draft's coverage by width on this traffic, for greedy (True) and sampled requests
        # apart: the policy's prior until anything was drafted, then running rates over every
        # verified tree, so a new request does not spend its first steps on an optimistic guess.
        policy = self.config.policy
        self.coverage = dict.fromkeys(
            (True, False), policy.initial(self.config.num_candidates, self.config.depth)
        )
        self.probes = ProbeSchedule(policy.probe_every)
        # The latest plan and what it was made from: while drafting is off nothing it reads
        # changes from step to step, so most steps reuse it (``_planned``).
        self.plan_inputs: tuple = ()
        self.latest_plan = config.budget
        # Measured whatever the drafter: a server attaches a remote drafter after construction.
        self.forward_cost = ForwardCost()
        if self.config.adaptive:
            limit = max(policy.token_budget, self.config.max_batch, target.backend.cost_tokens)
            self.forward_cost = measure_forward_cost(target, min(limit, target.capacity))
            budget = self.forward_cost.nearly_free(policy.nearly_free)
            if budget > policy.token_budget:  # measured on this device: more nodes ride for free
                self.config = replace(self.config, policy=replace(policy, token_budget=budget))
        self.step_cost = self.forward_cost  # read at the batch's context each step (``propose``)
        # Refitted to the forwards as they run where their time is known when they return.
        self.forward_times: ForwardTimes | None = None
        if self.config.adaptive and target.device.type == "cpu":
            self.forward_times = ForwardTimes(self.forward_cost)
        self.rows_alone = target.backend.ragged_rows
        # The draft's fixed and per-level cost in plain steps of this step's batch
        # (``CostMeter.ratios``), read once a step where the drafter drafts its own trees.
        self.draft_ratios = (0.0, 0.0)
        self.copies = CopySource(RecentOutputs(self.config.recent_outputs, self.config.recent_age))
        self.copy_checks = ProbeSchedule(1)  # while copies cannot pay: every step, then sparser
        self.prediction_yields = CopyYield()  # how predictions pay, apart from copies

    def propose(self, batch: list[Sequence], drafter: Drafter | None) -> list[Proposal]:
        """This step's tree per sequence of ``batch``: the drafter's where the policy gives one,
        with copy or prediction drafts grafted on where they pay; a root-only tree otherwise.
        The drafter's own time feeds the draft's cost per level (see ``CostMeter``): the
        planning around it is paid whether or not anything is drafted."""
        self.steps += 1
        self.step_cost = self.forward_cost.at(sum(s.cache_len for s in batch) // len(batch))
        proposals = [Proposal(TokenTree.chain([s.last_token])) for s in batch]
        base = [1.0] * len(batch)  # tokens each sequence's tree is expected to yield
        budgets = []
        if drafter is not None and not drafter.copy_only:
            self.draft_ratios = self.costs.ratios(self.step_cost.step(len(batch), 1))
            budgets = self._budgets(batch, drafter)
        own_trees = any(budget.depth > 0 for budget in budgets)
        copies = self._copy_drafts(batch, drafter is not None and drafter.takes_grafts, own_trees)
        seconds = 0.0
        if drafter is not None and own_trees:
            seconds = self._draft(batch, budgets, proposals, base, copies, drafter)
        self._graft_copies(batch, proposals, base, copies)
        # Draft time per level only from steps that drafted on caught-up caches (see CostMeter).
        drafting = [s for s, p in zip(batch, proposals, strict=True) if p.own_nodes > 1]
        steady = all(s.drafted_at == self.steps - 1 for s in drafting)
        levels = max(p.drafted_depth for p in proposals) if steady else 0
        self.costs.record(seconds, levels)
        for seq in drafting:
            seq.drafted_at = self.steps
        return proposals

    def learn(
        self, batch: list[Sequence], proposals: list[Proposal], acceptances: list[Acceptance]
    ) -> list[list[Outcome]]:
        """Fold the verified step into the coverage and a grafted copy draft's outcome into the
        copy policy's yields; returns each sequence's verified levels."""
        outcomes: list[list[Outcome]] = []
        observed: dict[bool, list[list[Outcome]]] = {True: [], False: []}
        for seq, proposal, acceptance in zip(batch, proposals, acceptances, strict=True):
            if proposal.copy_match:
                tried, accepted = graft_outcome(proposal.tree, proposal.own_nodes, acceptance.path)
                yields = self.prediction_yields if proposal.predicted else self.copies.yields
                yields.observe(proposal.copy_match, tried, accepted)
            outcomes.append(level_outcomes(*proposal.drafted_part(acceptance.path)))
            observed[seq.params.greedy].append(outcomes[-1])
        for greedy, levels in observed.items():
            self.coverage[greedy] = self.config.policy.update(self.coverage[greedy], levels)
        return outcomes

    def timed(self, batch: list[Sequence], proposals: list[Proposal], seconds: float) -> None:
        """The verification forward of ``batch``'s ``proposals`` took ``seconds``: now and then
        the curve the policy reads is refitted to the recent ones (``ForwardTimes``)."""
        if self.forward_times is None:
            return
        sizes = [len(p.tree) for p in proposals]
        if not self.rows_alone:  # every tree padded to the widest
            sizes = [max(sizes)] * len(sizes)
        cached = [(n, seq.cache_len) for n, seq in zip(sizes, batch, strict=True)]
        refitted = self.forward_times.record(cached, seconds)
        if refitted is not None:
            self.forward_cost = refitted

    def _budgets(self, batch: list[Sequence], drafter: Drafter) -> list[TreeBudget]:
        """The tree each sequence of ``batch`` drafts this step (depth 0: none)."""
        planned = self._planned(batch, drafter)
        return [self._budget(seq, tree) for seq, tree in zip(batch, planned, strict=True)]

    def _draft(
        self,
        batch: list[Sequence],
        budgets: list[TreeBudget],
        proposals: list[Proposal],
        base: list[float],
        copies: dict[int, Copy],
        drafter: Drafter,
    ) -> float:
        """The drafter's trees of ``budgets`` (``_budgets``), into ``proposals``, and the tokens
        each is expected to yield into ``base``; returns the seconds the drafter took. A
        sequence whose copy draft is worth at least its tree drafts none
        (``sources.model_drafts``)."""
        cfg, cost = self.config, self.step_cost
        requests = []
        fixed, per_level = self.draft_ratios
        for i, (seq, budget) in enumerate(zip(batch, budgets, strict=True)):
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
            return 0.0
        started = time.perf_counter()
        try:
            drafted = drafter.propose([r for _, r in requests])
        except Exception as exc:  # a failing drafter must never fail a request
            self.fallback(exc, [batch[i] for i, _ in requests])
            for i, _ in requests:
                base[i] = 1.0
            return 0.0
        for (i, _), proposal in zip(requests, drafted, strict=True):
            proposals[i] = proposal
        return time.perf_counter() - started

    def _planned(self, batch: list[Sequence], drafter: Drafter) -> list[TreeBudget]:
        """The adaptive policy's tree for each sequence of ``batch`` this step.

        One tree serves the whole batch: trees are padded to the widest in the batch, and one
        deep tree would make every sequence pay for its width and its draft forwards. While no
        tree pays, one sequence probes when the schedule says so: the one observed longest ago
        among those whose prompt the draft has seen, else among all (a probe of a sequence
        whose prefill the draft skipped feeds it the whole prompt first)."""
        cfg, cost = self.config, self.step_cost
        if not cfg.adaptive:
            return [cfg.budget] * len(batch)
        greedy = sum(s.params.greedy for s in batch)
        inputs = (cfg, self.coverage[True], self.coverage[False], greedy, len(batch), cost, self.draft_ratios)
        if inputs != self.plan_inputs:
            fixed, per_level = self.draft_ratios
            coverages = [self.coverage[True]] * greedy + [self.coverage[False]] * (len(batch) - greedy)
            self.latest_plan = cfg.policy.plan(cfg.budget, coverages, per_level, cost, fixed)
            self.plan_inputs = inputs
        planned = self.latest_plan
        self.drafting = planned.depth > 0
        trees = [planned] * len(batch)
        if planned.depth > 0:
            self.probes.reset()
        elif self.probes.due(cfg.policy.probe_interval(len(batch))):
            adaptive = [i for i, seq in enumerate(batch) if not fixed_tree(seq.params)]
            if adaptive:
                probed = min(adaptive, key=lambda i: (unseen_prompt(batch[i], drafter), batch[i].drafted_at))
                if not self._observe(batch[probed], drafter):
                    trees[probed] = cfg.policy.probe(cfg.budget, len(batch))
        return trees

    def _observe(self, seq: Sequence, drafter: Drafter) -> bool:
        """Probe a greedy or seeded sequence without a tree: rank the tokens the target chose
        since the draft last saw the sequence among the draft's guesses (``Drafter.observe``; a
        seeded sample's guesses are its race's winners). A probe tree pads every sequence of the
        batch to its width in the target's forward (docs/ENGINE.md); this costs one draft
        forward over the catch-up that drafting would make anyway.
        False when the drafter cannot (an unseeded sample's children are draws, not ranks)."""
        if not seq.params.greedy and seq.params.seed is None:
            return False
        width = self.config.num_candidates
        try:
            ranks = drafter.observe(seq.slot, seq.token_ids, width, len(seq.prompt_ids), sample_spec(seq))
        except Exception as exc:  # a failing drafter must never fail a request
            self.fallback(exc, [seq])
            return True
        if ranks is None:
            return False
        observed = [[(width, rank)] for rank in ranks]  # each a first-level guess
        greedy = seq.params.greedy
        self.coverage[greedy] = self.config.policy.update(self.coverage[greedy], observed)
        seq.drafted_at = self.steps
        return True

    def prefills_draft(self, seq: Sequence, drafter: Drafter) -> bool:
        """Whether ``drafter`` catches up on ``seq``'s prompt while the target prefills it: one
        that ``prefills`` does unless its prefill is optional (``Drafter.prefill_optional``);
        then only while the policy drafts trees or ``seq`` drafts its own. Otherwise its next
        proposal or probe feeds what it missed, and a sequence that ends first costs the draft
        nothing."""
        return drafter.prefills and (not drafter.prefill_optional or self.drafting or fixed_tree(seq.params))

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

    def _copy_drafts(self, batch: list[Sequence], takes_grafts: bool, own_trees: bool) -> dict[int, Copy]:
        """Each sequence's copy draft, by index in ``batch``: of its prediction's continuation
        where it aligns with the output (``engine/prediction.py``) and the continuation of its
        suffix where it occurred before, in its text or in recent outputs (``CopySource``; with a
        drafter that takes grafts, and not under a grammar), the one worth more
        (``sources.copy_worth``). None for a request that chose its own tree, and none at all
        where nothing drafts a tree this step (``own_trees``) and no copy could pay to widen the
        forward (``_copies_idle``). While none could, that check runs at doubling intervals, at
        most ``COPY_CHECKS_LONGEST`` steps and the batch's size apart, until a copy may pay or a
        tree is drafted again: in a batch its lookups per sequence are most of what planning
        costs where nothing pays, while a lone sequence checks every step, since a copy run
        found late costs it every token the run would have brought, and so does an engine
        whose speculation is fixed (not ``adaptive``)."""
        cfg = self.config
        longest = min(COPY_CHECKS_LONGEST, len(batch)) if cfg.adaptive else 1
        if not cfg.prompt_lookup or (not own_trees and not self.copy_checks.due(longest)):
            return {}
        limit, found = 1 + cfg.prompt_lookup, {}
        candidates = []  # each sequence's room, where its prediction aligns and its longest matches
        for i, seq in enumerate(batch):
            if fixed_tree(seq.params):
                continue
            room, aligned, best = min(cfg.prompt_lookup, self._room(seq)), None, []
            if seq.prediction is not None:
                seq.prediction.sync(seq.output_ids)
                aligned = seq.prediction.locate()
            if takes_grafts and seq.grammar is None:
                seq.own_text.sync(seq.prompt_ids, seq.output_ids)
                best = self.copies.longest(seq.own_text, seq.params.cache_scope)
            candidates.append(Candidate(i, seq, room, aligned, best))
        if not own_trees and self._copies_idle(candidates, len(batch)):
            return {}
        self.copy_checks.reset()
        for c in candidates:
            drafts = [
                (self._predicted(c.seq, c.aligned, c.room), True),
                (self.copies.draft_from(c.seq.last_token, c.best, c.room, cfg.prompt_lookup), False),
            ]
            kept = [(d, predicted) for d, predicted in drafts if d is not None and len(d.tree) > 1]
            worths = [copy_worth(d.reach, self.step_cost, len(batch), limit) for d, _ in kept]
            best = better_copy(worths)
            if best is not None:
                found[c.index] = Copy(kept[best][0], kept[best][1], worths[best])
        return found

    def _copies_idle(self, candidates: list[Candidate], batch: int) -> bool:
        """Whether no copy or prediction draft of ``candidates`` could be grafted onto a batch
        of root-only trees: the drafts' yield could not pay for a wider forward
        (``adaptive.copies_may_widen``). Then each draft's match relaxes as ``_graft_copies``
        relaxes an unused one, and no draft is built."""
        shapes: list[list[tuple[float, int]]] = []  # each sequence's drafts as made: (rate, depth)
        relaxing: list[tuple[CopyYield, int]] = []  # each draft's yields and match
        for c in candidates:
            drafts = []
            if c.aligned is not None and (
                shape := prediction_prospect(c.aligned, c.room, self.prediction_yields)
            ):
                drafts.append(shape)
                relaxing.append((self.prediction_yields, c.aligned.length))
            if shape := self.copies.prospect(c.best, c.room):
                drafts.append(shape)
                relaxing.append((self.copies.yields, c.best[0].length))
            shapes.append(drafts)
        if copies_may_widen(shapes, self.step_cost, batch, 1 + self.config.prompt_lookup):
            return False
        for yields, length in relaxing:
            yields.relax(length)
        return True

    def _graft_copies(
        self, batch: list[Sequence], proposals: list[Proposal], base: list[float], copies: dict[int, Copy]
    ) -> None:
        """Graft each sequence's copy draft (``_copy_drafts``) onto its tree, drafted or not.
        Where a reply repeats text (code edits, quotes, extraction, an agent's tool calls) it
        goes on far past where a draft's guesses fade, and costs microseconds. The forward is
        priced as padding every tree to the widest, so grafts fill that padding for free and
        widen the batch only while their expected tokens pay for the wider forward
        (``adaptive.copy_width`` over the measured ``ForwardCost``, against what each tree is
        expected to yield: ``base``), which they never do where matches are short and rarely
        accepted. Where the backend skips the padding (``ragged_rows``) that price is an upper
        bound, kept on purpose: grafts priced a row each were taken more often than their
        tokens paid for (docs/ENGINE.md). Not onto sampled children
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
        width = copy_width(own, base, reach, self.step_cost, 1 + cfg.prompt_lookup)
        for i, (tree, _, match, predicted) in drafts.items():
            keep = min(len(tree) - own[i], max(0, width - own[i]))
            if keep:
                trimmed = TokenTree(tree.tokens[: own[i] + keep], tree.parents[: own[i] + keep])
                proposals[i] = replace(
                    proposals[i], tree=trimmed, drafted=own[i], copy_match=match, predicted=predicted
                )
            else:
                (self.prediction_yields if predicted else self.copies.yields).relax(match)

    def _predicted(self, seq: Sequence, aligned: Match | None, room: int) -> CopyDraft | None:
        """``seq``'s prediction's chain after where its output ``aligned``
        (``prediction.prediction_draft``), cut to what its grammar allows; None without."""
        draft = prediction_draft(seq.last_token, aligned, room, self.prediction_yields)
        if draft is None:
            return None
        if seq.grammar is not None:
            allowed = seq.grammar.valid_prefix(list(draft.tree.tokens[1:]))
            draft = replace(
                draft, tree=TokenTree.chain(draft.tree.tokens[: 1 + allowed]), reach=draft.reach[:allowed]
            )
        return draft


def unseen_prompt(seq: Sequence, drafter: Drafter) -> bool:
    """Whether ``drafter`` has yet to see part of ``seq``'s prompt before its last token (what
    a prefill feeds): it skipped that prefill."""
    return drafter.behind(seq.slot, len(seq.prompt_ids) - 1) > 0


def fixed_tree(params: SamplingParams) -> bool:
    """Whether a request drafts its own fixed tree instead of the policy's: it set one. A
    seeded sample follows the policy too: its output does not depend on the trees drafted
    (``acceptance.SeededChoices``), so timing and batch neighbours cannot change it."""
    return params.depth is not None or params.num_candidates is not None


def sample_spec(seq: Sequence) -> SampleSpec | None:
    """Sampled requests draw their children from the draft (seeded ones take the draft's best
    under the noise their target draws with); greedy ones take its top-k."""
    if seq.params.greedy:
        return None
    return SampleSpec(seq.processing, seq.generators, coupled=seq.params.seed is not None)
