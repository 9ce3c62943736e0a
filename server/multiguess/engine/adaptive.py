"""Adaptive speculation: how big a tree the batch's sequences get this step (a pure policy).

Four signals decide. *Acceptance*: level i of a tree is reached with probability about a^i
(a = the draft's per-level acceptance rate on this traffic, a running estimate over every
tree the engine drafted; one tree shape serves the whole batch), so drafting d levels
yields ``1 + a + … + a^d`` tokens per step. *Draft cost*: each level costs ``r`` plain target
steps (r = measured draft time per level / the target's plain step at this batch size; steps
in which a sequence's draft first caught up on tokens it had not seen are left out: that
catch-up is paid once when drafting resumes, not per level).
*Verification cost*: verifying n nodes per sequence costs ``g`` plain steps, read from the
target's forward time by tokens in the forward (``ForwardCost``, measured when the engine
starts): nearly 1 while the forward is memory-bound, growing once it is compute-bound, which
on a CPU happens at a few dozen tokens, so a batch of 8 verifying 4 nodes each can cost 1.7×
its plain step. The step costs ``g + d·r``; the tree maximises tokens per cost, and nothing is
drafted when no tree beats plain decoding by ``min_speedup``. *Load*: ``token_budget`` nodes
are shared by the batch at most: few sequences get bushy trees, many get chains, very many get
none.

While nothing is drafted, one sequence at a time *probes* with a one-level tree, so the estimate
can recover: the one observed longest ago, after ``probe_every`` steps, then at doubling
intervals up to ``probe_every`` × batch size (at most ``probe_every_max``) while probes keep
finding that drafting does not pay (see ``ProbeSchedule``): alone, a sequence probes every
``probe_every`` steps, because its probe's catch-up is short and a good stretch of text (code,
a quote) should turn drafting back on within a few tokens. One sequence, because a probe makes
the draft catch up on everything that sequence added since it last drafted — its whole prompt,
for a new request: when the batch probed at once, a batch of 8 paid ~47 ms of draft catch-up
every 64 steps (~2% of its throughput) for estimates that kept saying no. The probe is as wide as the budget allows while
its extra tokens cost the target's forward almost nothing (width costs the draft nothing, and a
chain probe would measure a lower rate than the trees it stands for), a single node otherwise.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from multiguess.engine.drafter import TreeBudget


def expected_speedup(acceptance: float, depth: int, cost_ratio: float, verify_growth: float = 1.0) -> float:
    """Tokens per plain-step-equivalent for a ``depth``-level draft (1.0 = plain decoding)."""
    tokens = sum(acceptance**i for i in range(depth + 1))
    return tokens / (verify_growth + depth * cost_ratio)


@dataclass(frozen=True)
class ForwardCost:
    """Target forward time by the number of tokens in it (piecewise linear between measured
    points, linear beyond the last two). Without measurements every forward costs the same."""

    tokens: tuple[int, ...] = (1,)
    seconds: tuple[float, ...] = (1.0,)

    def __call__(self, count: int) -> float:
        i = bisect.bisect_left(self.tokens, count)
        if i < len(self.tokens) and self.tokens[i] == count:
            return self.seconds[i]
        if len(self.tokens) == 1:
            return self.seconds[0]
        i = min(max(i, 1), len(self.tokens) - 1)
        (t0, t1), (s0, s1) = self.tokens[i - 1 : i + 1], self.seconds[i - 1 : i + 1]
        return max(s0 + (s1 - s0) * (count - t0) / (t1 - t0), min(self.seconds))

    def growth(self, batch: int, nodes: int) -> float:
        """Cost of verifying ``nodes`` per sequence (root included) relative to a plain step."""
        return self(batch * nodes) / self(batch)


@dataclass(frozen=True)
class AdaptivePolicy:
    token_budget: int = 32  # tree nodes (roots included) one target forward verifies at most
    min_speedup: float = 1.1  # speculate only when the best tree is expected to win this much
    smoothing: float = 0.3  # weight of the newest observation in the acceptance average
    prior: float = 0.5  # acceptance assumed before a sequence has any history
    probe_every: int = 8  # steps from drafting stopping to the first probe
    probe_every_max: int = 64  # longest interval between probes while they keep finding no gain
    probe_growth: float = 1.05  # a probe is as wide as the budget if that forward costs this little

    def probe_interval(self, batch_size: int) -> int:
        """The longest wait between probes at this batch size (see the module's docstring)."""
        return min(self.probe_every_max, self.probe_every * max(1, batch_size))

    def plan(
        self,
        base: TreeBudget,
        acceptance: float,
        batch_size: int,
        cost_ratio: float,
        forward_cost: ForwardCost | None = None,
    ) -> TreeBudget:
        """The tree every sequence of the batch drafts, at most ``base``; depth 0 when none pays."""
        batch, nodes = max(1, batch_size), self.room(base, batch_size)
        off = TreeBudget(base.num_candidates, 0, base.max_nodes)
        if nodes < 1:
            return off
        cost = forward_cost or ForwardCost()
        trees = [self._tree(base, nodes, depth) for depth in range(1, min(base.depth, nodes) + 1)]

        def speedup(tree: TreeBudget) -> float:
            growth = cost.growth(batch, 1 + tree.max_nodes)
            return expected_speedup(acceptance, tree.depth, cost_ratio, growth)

        best = max(trees, key=speedup)
        return best if speedup(best) >= self.min_speedup else off

    def probe(self, base: TreeBudget, batch_size: int, forward_cost: ForwardCost | None = None) -> TreeBudget:
        """The one-level tree one sequence of the batch probes with (depth 0: no tree fits)."""
        batch, nodes = max(1, batch_size), self.room(base, batch_size)
        if nodes < 1:
            return TreeBudget(base.num_candidates, 0, base.max_nodes)
        level = self._tree(base, nodes, 1)
        cost = forward_cost or ForwardCost()
        wide = cost(batch + level.max_nodes) / cost(batch) <= self.probe_growth
        return level if wide else TreeBudget(1, 1, 1)

    def room(self, base: TreeBudget, batch_size: int) -> int:
        """Drafted nodes each sequence may have: the batch's share of ``token_budget`` less its
        root (0 when no tree fits or ``base`` drafts nothing)."""
        if base.depth == 0:
            return 0
        return max(0, self.token_budget // max(1, batch_size) - 1)

    @staticmethod
    def _tree(base: TreeBudget, nodes: int, depth: int) -> TreeBudget:
        """The ``depth``-level tree within ``nodes``: as wide as room allows, as big as the
        drafter can fill (``width`` children at the first level, ``width²`` at each next)."""
        width = base.num_candidates if nodes >= 2 * depth else 1
        size = min(base.max_nodes, nodes, width + (depth - 1) * width * width)
        return TreeBudget(width, depth, size)

    @staticmethod
    def observed(accepted: int, drafted_depth: int) -> float | None:
        """The per-level rate one tree showed (``accepted`` of its ``drafted_depth`` levels).

        Levels are tried until one fails, so the step tried ``min(accepted + 1, depth)`` levels
        and ``accepted`` of them succeeded: their ratio estimates the per-level rate.
        """
        if drafted_depth <= 0:
            return None
        return accepted / min(accepted + 1, drafted_depth)

    def update(self, acceptance: float, observed: list[float]) -> float:
        """Fold one step's observations (one per drafted tree) into the estimate, as their mean:
        a step of a big batch counts once, not once per sequence."""
        if not observed:
            return acceptance
        mean = sum(observed) / len(observed)
        return (1 - self.smoothing) * acceptance + self.smoothing * mean


@dataclass
class ProbeSchedule:
    """When the next probe runs while drafting is off: ``first`` steps after it stopped, then
    at doubling intervals up to the caller's ``longest``; ``reset`` when drafting pays again."""

    first: int
    interval: int = 0
    wait: int = 0

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.interval = self.wait = self.first

    def due(self, longest: int) -> bool:
        """Count one step without drafting; True when it is a probe's."""
        self.wait -= 1
        if self.wait > 0:
            return False
        self.interval = max(self.first, min(2 * self.interval, longest))
        self.wait = self.interval
        return True


@dataclass
class CostMeter:
    """Running draft and verification times of the engine's steps, for ``cost_ratio``."""

    smoothing: float = 0.2
    prior_ratio: float = 0.1  # assumed before anything was measured: a small draft
    draft_per_level: float | None = None
    verify: float | None = None

    def record(self, draft_seconds: float, levels: int, verify_seconds: float) -> None:
        self.verify = self._blend(self.verify, verify_seconds)
        if levels > 0:
            self.draft_per_level = self._blend(self.draft_per_level, draft_seconds / levels)

    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def ratio(self, plain_step: float | None = None) -> float:
        """Draft time per level in units of ``plain_step`` (default: the measured verification)."""
        reference = plain_step or self.verify
        if self.draft_per_level is None or not reference:
            return self.prior_ratio
        return self.draft_per_level / reference
