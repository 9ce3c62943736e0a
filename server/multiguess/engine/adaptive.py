"""Adaptive speculation: how big a tree each sequence gets this step (a pure policy).

Three signals decide. *Acceptance*: level i of a tree is reached with probability about a^i
(a = the sequence's per-level acceptance rate, a running estimate), so drafting d levels
yields ``1 + a + … + a^d`` tokens per step. *Draft cost*: each level costs ``r`` target
forwards (r = measured draft time per level / measured verification time, for the current
batch), so the step costs ``1 + d·r``. The depth maximises tokens per cost, and is 0 (no
speculation) when no depth beats plain decoding by ``min_speedup``. *Load*: one target forward
verifies every sequence's tree, and its cost grows with the total number of tree nodes once
the batch is large, so ``token_budget`` nodes are shared by the batch: few sequences get bushy
trees, many get chains, very many get none. A sequence that stopped drafting still probes
with a one-level tree every ``probe_every`` steps, so its estimate can recover. The probe is
as wide as the budget allows: width costs the draft nothing (one forward per level) and the
target little, and a chain probe would measure a lower rate than the trees it stands for.
"""

from __future__ import annotations

from dataclasses import dataclass

from multiguess.engine.drafter import TreeBudget


def expected_speedup(acceptance: float, depth: int, cost_ratio: float) -> float:
    """Tokens per target-forward-equivalent for a ``depth``-level draft (1.0 = plain decoding)."""
    tokens = sum(acceptance**i for i in range(depth + 1))
    return tokens / (1 + depth * cost_ratio)


@dataclass(frozen=True)
class AdaptivePolicy:
    token_budget: int = 32  # tree nodes (roots included) one target forward verifies at most
    min_speedup: float = 1.05  # speculate only when the best depth is expected to win this much
    smoothing: float = 0.3  # weight of the newest observation in the acceptance average
    prior: float = 0.5  # acceptance assumed before a sequence has any history
    probe_every: int = 8  # steps between one-token probes when drafting does not pay

    def plan(
        self, base: TreeBudget, acceptance: float, batch_size: int, step: int, cost_ratio: float
    ) -> TreeBudget:
        """The tree budget for one sequence, at most ``base``."""
        nodes = self.token_budget // max(1, batch_size) - 1
        if nodes < 1 or base.depth == 0:
            return TreeBudget(base.num_candidates, 0, base.max_nodes)
        deepest = min(base.depth, nodes)
        depth = max(range(1, deepest + 1), key=lambda d: expected_speedup(acceptance, d, cost_ratio))
        width = base.num_candidates if nodes >= 2 * depth else 1
        if expected_speedup(acceptance, depth, cost_ratio) < self.min_speedup:
            probe = step % self.probe_every == 0
            return TreeBudget(min(base.num_candidates, nodes), 1 if probe else 0, base.max_nodes)
        return TreeBudget(width, depth, max(1, min(base.max_nodes, nodes)))

    def update(self, acceptance: float, accepted: int, drafted_depth: int) -> float:
        """Fold one step (``accepted`` levels of a ``drafted_depth``-deep tree) into the estimate.

        Levels are tried until one fails, so the step tried ``min(accepted + 1, depth)`` levels
        and ``accepted`` of them succeeded: their ratio estimates the per-level rate.
        """
        if drafted_depth <= 0:
            return acceptance
        observed = accepted / min(accepted + 1, drafted_depth)
        return (1 - self.smoothing) * acceptance + self.smoothing * observed


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

    @property
    def ratio(self) -> float:
        if self.draft_per_level is None or not self.verify:
            return self.prior_ratio
        return self.draft_per_level / self.verify
