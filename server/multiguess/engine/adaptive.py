"""Adaptive speculation: how big a tree each sequence gets this step (a pure policy).

Two signals decide. *Acceptance*: level i of a chain is accepted with probability about a^i
(a = the sequence's per-level acceptance rate), so a level is worth drafting only while a^i,
the tokens it is expected to add, stays above ``min_gain``. *Load*: one target forward
verifies every sequence's tree, and its cost grows with the total number of tree nodes once
the batch is large, so ``token_budget`` nodes are shared by the batch: few sequences get bushy
trees, many get chains, very many get none. A sequence whose drafts stop paying still probes
with a one-token chain every ``probe_every`` steps, so its estimate can recover.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from multiguess.engine.drafter import TreeBudget


@dataclass(frozen=True)
class AdaptivePolicy:
    token_budget: int = 64  # tree nodes (roots included) one target forward verifies at most
    min_gain: float = 0.1  # expected accepted tokens a drafted level must add
    smoothing: float = 0.3  # weight of the newest observation in the acceptance average
    prior: float = 0.5  # acceptance assumed before a sequence has any history
    probe_every: int = 8  # steps between one-token probes when drafting does not pay

    def plan(self, base: TreeBudget, acceptance: float, batch_size: int, step: int) -> TreeBudget:
        """The tree budget for one sequence, at most ``base``."""
        nodes = self.token_budget // max(1, batch_size) - 1
        if nodes < 1 or base.depth == 0:
            return TreeBudget(base.num_candidates, 0, base.max_nodes)
        if acceptance < self.min_gain:
            probe = step % self.probe_every == 0
            return TreeBudget(1, 1 if probe else 0, base.max_nodes)
        depth = base.depth if acceptance >= 1 else int(math.log(self.min_gain) / math.log(acceptance))
        depth = max(1, min(base.depth, depth, nodes))
        width = base.num_candidates if nodes >= 2 * depth else 1
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
