"""Adaptive speculation: how big a tree the batch's sequences get this step (a pure policy).

Four signals decide. *Acceptance by width and depth*: a drafted node with c children lets
the path go on when the target's token is among them, which happens at the draft's top-c
*coverage* on this traffic (``Coverage``: running estimates for c = 1 … num_candidates at each
depth, every verified tree observing each level its accepted path tried). A chain drafts one
child per level and goes on at the top-1 rate; a tree of width 3 at the top-3 rate, which is
higher. So each tree shape's expected tokens follow from the coverage and the tree the drafter
would grow (``expected_tokens``). *Draft cost*: a drafting step costs ``f`` plain target steps
and each level ``r`` more (``CostMeter``'s fit of the measured draft time over the target's
plain step at this batch size; steps in which a sequence's draft first caught up on tokens it
had not seen are left out: that catch-up is paid once when drafting resumes). *Verification
cost*: verifying n nodes per sequence costs ``g`` plain steps, read from the target's forward
time by tokens in the forward (``ForwardCost``, measured when the engine starts, on CPUs then
refitted to the forwards as they run: ``forward_times``): nearly 1 while the forward is
memory-bound, growing once it is compute-bound, which on a CPU happens at a few tokens (on AMX
tiles, at many more). A step costs ``g + f + d·r``; the plan tries every
width and depth within the budget and keeps the shape with the most tokens per cost, and
nothing is drafted when none beats plain decoding by ``min_speedup``. *Load*: ``token_budget``
nodes are shared by the batch at most: few sequences get bushy trees, many get chains, very
many get none.

While nothing is drafted, one sequence at a time *probes*, so the estimates can recover: the
one observed longest ago, after ``probe_every`` steps, then at doubling intervals up to
``probe_every`` × batch size (at most ``probe_every_max``) while probes keep finding that
drafting does not pay (see ``ProbeSchedule``): alone, a sequence probes every ``probe_every``
steps, because a good stretch of text (code, a quote) should turn drafting back on within a few
tokens. A greedy sequence probes by *observation* (``Drafter.observe``): the draft catches up
on the tokens the target chose since it last saw the sequence and ranks each among its guesses,
which is what a verified tree would have measured, at no cost to the target. Other sequences
probe with a one-level tree as wide as the budget allows (it measures every width's coverage at
once), which pads the whole batch to its width in the target's forward. One sequence at a time,
because a probe makes the draft catch up on everything that sequence added since it last
drafted — its whole prompt, for a new request: a whole batch probing at once pays every
sequence's catch-up together for estimates that keep saying no (docs/ENGINE.md).
"""

from __future__ import annotations

import bisect
import collections
import functools
import itertools
import statistics
from dataclasses import dataclass, field, replace

from multiguess.engine.drafter import TreeBudget
from multiguess.engine.tree import TokenTree

PLAN_DIGITS = 2  # the precision plans read the estimates and cost ratios at

# One level a verified tree's accepted path tried: how many children the path's node had, and
# the rank among them of the child the target accepted (None: none was, the path ended there).
Outcome = tuple[int, int | None]


@dataclass(frozen=True)
class Coverage:
    """``rates[c - 1]``: how often the target's next token is among the draft's ``c`` best
    children of a first-level node (sampled requests: its first ``c`` draws), c = 1 … the
    widest tree; ``deeper[d - 2]`` the same at depth d, once the path reached that deep, the
    last of them for every depth below. Acceptance rises with depth (text the draft got right
    twice is text it tends to go on getting right), so one rate for all depths would price
    deep trees below what they yield. Without ``deeper`` every depth has ``rates``."""

    rates: tuple[float, ...]
    deeper: tuple[tuple[float, ...], ...] = ()

    @classmethod
    def prior(cls, top1: float, width: int, depth: int = 1) -> Coverage:
        """Before anything was verified: ``top1`` at every depth, and wider as if each child
        were an independent try. Optimistic for wide trees on purpose, so that they are tried
        and measured (a chain never observes what width would have caught)."""
        rates = tuple(round(1 - (1 - top1) ** c, 3) for c in range(1, max(1, width) + 1))
        return cls(rates, (rates,) * (depth - 1))

    def rounded(self, digits: int) -> Coverage:
        return Coverage(
            tuple(round(r, digits) for r in self.rates),
            tuple(tuple(round(r, digits) for r in rates) for rates in self.deeper),
        )

    def at(self, depth: int) -> tuple[float, ...]:
        """The rates by width of nodes ``depth`` levels below the root (1: its children)."""
        levels = (self.rates, *self.deeper)
        return levels[min(depth, len(levels)) - 1]

    def __call__(self, children: int, depth: int = 1) -> float:
        """The rate for ``children`` children (none: 0) at ``depth``, never below a narrower
        width's: the estimates of different widths come from different levels and can cross."""
        return max(self.at(depth)[:children], default=0.0)

    def updated(self, trees: list[list[Outcome]], per_outcome: float, most: float) -> Coverage:
        """Fold one step's verified trees in, each as the levels its accepted path tried (root
        first, ``level_outcomes``), every depth into its own rates (the deepest tracked takes
        all below it): for each width c, the levels that had at least c children say whether
        the accepted child was among the first c. Each outcome weighs ``per_outcome`` and a
        depth's outcomes of one step at most ``most``, so a big batch's step does not erase
        the history and a lone sequence's one level does not swing it."""
        if not any(trees):  # a step that verified no drafted level: nothing to fold in
            return self
        levels = [list(self.rates), *(list(rates) for rates in self.deeper)]
        for depth, rates in enumerate(levels):
            last = depth == len(levels) - 1
            outcomes = [o for tree in trees for o in (tree[depth:] if last else tree[depth : depth + 1])]
            for c in range(1, len(rates) + 1):
                seen = [rank is not None and rank < c for children, rank in outcomes if children >= c]
                if seen:
                    weight = min(most, per_outcome * len(seen))
                    rates[c - 1] += weight * (sum(seen) / len(seen) - rates[c - 1])
        first, *rest = (tuple(round(rate, 3) for rate in rates) for rates in levels)
        return Coverage(first, tuple(rest))


def level_outcomes(tree: TokenTree, path: list[int]) -> list[Outcome]:
    """The levels a verified tree's accepted ``path`` (root first) tried, in order: at each
    node on it that has children, their number and the rank of the accepted one (children are
    in the drafter's rank order), up to the first level where none was accepted."""
    children = tree.children()
    outcomes: list[Outcome] = []
    for depth, node in enumerate(path):
        kids = children[node]
        if not kids:
            break
        following = path[depth + 1] if depth + 1 < len(path) else None
        outcomes.append((len(kids), None if following is None else kids.index(following)))
    return outcomes


def expected_tokens(coverage: Coverage, tree: TreeBudget) -> float:
    """Tokens one verification of ``tree``'s shape yields, the bonus token included.

    The target takes a node's child of rank r with probability ``p[r] = coverage(r + 1) -
    coverage(r)``, level after level, so a node is reached with the product of its path's
    ``p`` and the expected accepted length is the sum over the tree's nodes. The tree is the
    one ``drafters/growing.TreeGrower`` grows: per level every beam node gets ``num_candidates``
    children, the spine child and the likeliest others form the next beam, and the kept nodes
    are the spine and then the likeliest others."""
    if tree.depth == 0:
        return 1.0
    levels = tuple(coverage.at(depth) for depth in range(1, tree.depth + 1))
    spine, others = _reach(levels, tree.num_candidates, tree.depth)
    kept = min(tree.max_nodes, tree.depth)
    return 1.0 + spine[kept] + others[min(len(others) - 1, tree.max_nodes - kept)]


@functools.lru_cache(maxsize=1024)
def _reach(levels: tuple[tuple[float, ...], ...], width: int, depth: int) -> tuple[list[float], list[float]]:
    """How likely the path is to reach the drafter's candidates ``depth`` levels deep (level
    i's rates by width: ``levels[i]``), as running sums: of the spine's first i nodes, and of
    the i likeliest others. Cached: a plan asks for every shape, and the estimates are kept to
    three decimals."""
    spine: list[float] = []
    others: list[float] = []
    beam = [(1.0, True)]
    for rates in levels[:depth]:
        coverage = Coverage(rates)
        p = [coverage(r + 1) - coverage(r) for r in range(width)]
        children = [(reach * p[r], on_spine and r == 0) for reach, on_spine in beam for r in range(width)]
        spine += [reach for reach, on_spine in children if on_spine]
        rest = sorted((reach for reach, on_spine in children if not on_spine), reverse=True)
        others += rest
        beam = [(spine[-1], True), *((reach, False) for reach in rest[: width - 1])]
    return [0.0, *itertools.accumulate(spine)], [0.0, *itertools.accumulate(sorted(others, reverse=True))]


CONTEXT_STEP = 64  # cached tokens a step's cost is read at a time (ForwardCost.at)


def without_attention(seconds: float, attention: float) -> float:
    """A forward's ``seconds`` less the ``attention`` priced for it (what its matmuls took),
    never below half: a slope fitted to noise (a tiny model's forwards) must not make the
    matmuls, or a plain step, free."""
    return max(seconds - attention, seconds / 2)


@dataclass(frozen=True)
class ForwardCost:
    """Target forward time by the number of tokens in it (piecewise linear between measured
    points, linear beyond the last two), and what attention over the cache adds: each sequence
    of a step pays ``per_sequence + per_row * rows`` seconds for every token cached before it
    (reading its cache once for all its rows, then each row's own products), ``context`` tokens
    each on average (``at``). A forward's matmuls share the weights' reads across all its
    rows, a sequence's attention only across that sequence's, so at long contexts an extra row
    costs more than the bare curve says, the more so in a small batch (docs/ENGINE.md). Without
    measurements every forward costs the same."""

    tokens: tuple[int, ...] = (1,)
    seconds: tuple[float, ...] = (1.0,)
    per_sequence: float = 0.0
    per_row: float = 0.0
    context: int = 0
    # Each count's time, as first asked: a step asks for the same few counts many times over.
    known: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)
    # The cost at each context read (``at``), by the context rounded to CONTEXT_STEP.
    contexts: dict[int, ForwardCost] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __call__(self, count: int) -> float:
        seconds = self.known.get(count)
        if seconds is None:
            seconds = self.known[count] = self._interpolate(count)
        return seconds

    def _interpolate(self, count: int) -> float:
        i = bisect.bisect_left(self.tokens, count)
        if i < len(self.tokens) and self.tokens[i] == count:
            return self.seconds[i]
        if len(self.tokens) == 1:
            return self.seconds[0]
        i = min(max(i, 1), len(self.tokens) - 1)
        (t0, t1), (s0, s1) = self.tokens[i - 1 : i + 1], self.seconds[i - 1 : i + 1]
        return max(s0 + (s1 - s0) * (count - t0) / (t1 - t0), min(self.seconds))

    def at(self, context: int) -> ForwardCost:
        """This cost for steps whose sequences have ``context`` cached tokens on average, read
        in steps of ``CONTEXT_STEP`` (so plans cached on it change only that often)."""
        if not (self.per_sequence or self.per_row):
            return self
        context = round(context / CONTEXT_STEP) * CONTEXT_STEP
        cost = self.contexts.get(context)
        if cost is None:
            cost = self.contexts[context] = replace(self, context=context)
        return cost

    def step(self, batch: int, nodes: int) -> float:
        """Seconds of a forward verifying ``nodes`` per sequence (root included) of ``batch``."""
        return self(batch * nodes) + batch * self.attended(nodes, self.context)

    def attended(self, rows: int, context: int) -> float:
        """Seconds attention adds for a sequence of ``rows`` rows after ``context`` cached tokens."""
        return (self.per_sequence + self.per_row * rows) * context

    def growth(self, batch: int, nodes: int) -> float:
        """Cost of verifying ``nodes`` per sequence (root included) relative to a plain step."""
        return self.step(batch, nodes) / self.step(batch, 1)

    def nearly_free(self, tolerance: float) -> int:
        """The most measured tokens one forward takes within ``1 + tolerance`` of one token's
        time: on a GPU, where extra rows ride on the weights' reads, a batch may verify that many
        nodes together; on CPUs the curve rises sooner and the policy's own budget stays."""
        limit = self.seconds[0] * (1 + tolerance)
        return max(t for t, s in zip(self.tokens, self.seconds, strict=True) if s <= limit)


@dataclass(frozen=True)
class AdaptivePolicy:
    token_budget: int = 32  # tree nodes (roots included) one target forward verifies at most
    min_speedup: float = 1.05  # speculate only when the best tree is expected to win this much
    smoothing: float = 0.1  # weight of one observed level in the coverage estimates
    step_weight: float = 0.3  # the most one step's observations weigh together
    prior: float = 0.5  # top-1 acceptance assumed before anything was verified
    probe_every: int = 8  # steps from drafting stopping to the first probe
    probe_every_max: int = 64  # longest interval between probes while they keep finding no gain
    nearly_free: float = 0.25  # a forward this close to one token's time raises token_budget

    def initial(self, width: int, depth: int) -> Coverage:
        return Coverage.prior(self.prior, width, depth)

    def update(self, coverage: Coverage, trees: list[list[Outcome]]) -> Coverage:
        return coverage.updated(trees, self.smoothing, self.step_weight)

    def probe_interval(self, batch_size: int) -> int:
        """The longest wait between probes at this batch size (see the module's docstring)."""
        return min(self.probe_every_max, self.probe_every * max(1, batch_size))

    def plan(
        self,
        base: TreeBudget,
        coverages: list[Coverage],
        cost_ratio: float,
        forward_cost: ForwardCost | None = None,
        step_ratio: float = 0.0,
    ) -> TreeBudget:
        """The tree every sequence of the batch drafts, at most ``base``; depth 0 when none pays.
        Drafting costs ``step_ratio`` plain steps a step and ``cost_ratio`` a level.

        ``coverages`` holds each sequence's estimates (the engine keeps one for greedy and one
        for sampled requests, whose rates differ several-fold); a shape's tokens are their mean.
        Plans are remembered, and read their inputs to two decimals (finer differences change
        no plan): while drafting is off nothing they read changes from step to step, and while
        it is on, every step's verified tree moves the estimates by a little."""
        kinds: collections.Counter[Coverage] = collections.Counter()
        for coverage, count in collections.Counter(coverages).items():  # a batch holds one or two
            kinds[coverage.rounded(PLAN_DIGITS)] += count
        cost = forward_cost or ForwardCost()
        ratios = round(cost_ratio, PLAN_DIGITS), round(step_ratio, PLAN_DIGITS)
        return self._plan(base, tuple(kinds.items()), len(coverages), ratios[0], cost, ratios[1])

    @functools.lru_cache(maxsize=1024)  # noqa: B019 - policies are few and live as long as engines
    def _plan(
        self,
        base: TreeBudget,
        kinds: tuple[tuple[Coverage, int], ...],
        batch: int,
        cost_ratio: float,
        cost: ForwardCost,
        step_ratio: float,
    ) -> TreeBudget:
        batch, nodes = max(1, batch), self.room(base, batch)
        off = TreeBudget(base.num_candidates, 0, base.max_nodes)
        if nodes < 1:
            return off
        shapes = self._shapes(base, nodes)
        growth = {size: cost.growth(batch, 1 + size) for size in {tree.max_nodes for tree in shapes}}

        def speedup(tree: TreeBudget) -> float:
            tokens = sum(count * expected_tokens(c, tree) for c, count in kinds) / batch
            return tokens / (growth[tree.max_nodes] + step_ratio + tree.depth * cost_ratio)

        best = max(shapes, key=speedup)
        return best if speedup(best) >= self.min_speedup else off

    def probe(self, base: TreeBudget, batch_size: int) -> TreeBudget:
        """The one-level tree one sequence of the batch probes with (depth 0: no tree fits): as
        wide as room allows, since one level's width costs the draft nothing and measures the
        coverage of every width up to it."""
        nodes = self.room(base, batch_size)
        if nodes < 1:
            return TreeBudget(base.num_candidates, 0, base.max_nodes)
        width = min(base.num_candidates, nodes)
        return TreeBudget(width, 1, width)

    def room(self, base: TreeBudget, batch_size: int) -> int:
        """Drafted nodes each sequence may have: the batch's share of ``token_budget`` less its
        root (0 when no tree fits or ``base`` drafts nothing)."""
        if base.depth == 0:
            return 0
        return max(0, self.token_budget // max(1, batch_size) - 1)

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def _shapes(base: TreeBudget, nodes: int) -> tuple[TreeBudget, ...]:
        """Every width and depth within ``base`` and ``nodes``, a few sizes each, smallest
        first (so that of equally good shapes the plan keeps the smallest)."""
        shapes = {
            shape
            for width in range(1, base.num_candidates + 1)
            for depth in range(1, min(base.depth, nodes) + 1)
            for shape in AdaptivePolicy._trees(base, nodes, width, depth)
        }
        return tuple(sorted(shapes, key=lambda t: (t.max_nodes, t.depth, t.num_candidates)))

    @staticmethod
    def _trees(base: TreeBudget, nodes: int, width: int, depth: int) -> list[TreeBudget]:
        """``depth``-level trees of ``width`` within ``nodes``: the spine plus the first level's
        other children, the spine and about one node per level besides, and as big as the
        drafter can fill (``width`` children at the first level, ``width²`` at each next)."""
        width = min(width, nodes)
        largest = min(base.max_nodes, nodes, width + (depth - 1) * width * width)
        depth = min(depth, largest)
        sizes = {min(largest, size) for size in (depth + width - 1, depth * width, largest)}
        return [TreeBudget(width, depth, size) for size in sizes]


@dataclass
class ProbeSchedule:
    """When the next check runs while checks keep finding nothing to do: ``first`` steps after
    the last that found some, then at doubling intervals up to the caller's ``longest``;
    ``reset`` when one finds some again. The planner's probes (while drafting is off) and copy
    checks (while no copy can pay) follow one each."""

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
    """The draft's time per drafting step, as a fixed part (catching up on the accepted tokens,
    assembling the tree) plus a part per level, fitted to the latest ``window`` steps that
    drafted on caught-up caches once ``min_samples`` have. Theil-Sen: the median of the slopes
    between steps of different depths, then the median of what is left, so one stalled step (a
    page-fault storm, another process on the cores) moves neither: nothing is measured while
    drafting is off, and an inflated estimate would keep it off for good. Steps all of one depth
    fit a line through zero (their median time per level). Pricing every level at a step's
    mean per level would make deep trees look dearer than they are, and once the plan stays
    shallow, nothing would show otherwise."""

    window: int = 15
    min_samples: int = 3
    prior_ratio: float = 0.1  # per level, assumed before enough was measured: a small draft
    samples: collections.deque[tuple[int, float]] = field(init=False)
    _fit: tuple[float, float] | None = field(init=False, default=None)
    _fresh: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.samples = collections.deque(maxlen=self.window)

    def record(self, draft_seconds: float, levels: int) -> None:
        if levels > 0:
            self.samples.append((levels, draft_seconds))
            self._fresh = False

    def fitted(self) -> tuple[float, float] | None:
        """Seconds per drafting step and per level, or None before ``min_samples`` steps; kept
        until the next sample (every step's plan reads it)."""
        if not self._fresh:
            self._fit, self._fresh = self._fitted(), True
        return self._fit

    def _fitted(self) -> tuple[float, float] | None:
        if len(self.samples) < self.min_samples:
            return None
        slopes = [
            (s1 - s0) / (d1 - d0)
            for (d0, s0), (d1, s1) in itertools.combinations(self.samples, 2)
            if d1 != d0
        ]
        if not slopes:
            return 0.0, statistics.median(seconds / levels for levels, seconds in self.samples)
        per_level = max(0.0, statistics.median(slopes))
        return max(0.0, statistics.median(s - per_level * d for d, s in self.samples)), per_level

    @property
    def draft_per_level(self) -> float | None:
        fit = self.fitted()
        return None if fit is None else fit[1]

    def ratios(self, plain_step: float) -> tuple[float, float]:
        """The fixed and the per-level cost in units of ``plain_step`` (the target's plain step
        at this batch size)."""
        fit = self.fitted()
        if fit is None or not plain_step:
            return 0.0, self.prior_ratio
        return fit[0] / plain_step, fit[1] / plain_step


COPY_BUCKETS = 7  # match lengths 1, 2, 3-4, 5-8, 9-16, 17-32, 33 and more


def match_bucket(length: int) -> int:
    """The yield bucket of a copy match of ``length`` tokens: by powers of two."""
    return min(max(0, length - 1).bit_length(), COPY_BUCKETS - 1)


@dataclass
class CopyYield:
    """How often the next token of a copy draft is accepted, by the length of the match it
    came from (``match_bucket``): a long verbatim match goes on far more surely than a two-token
    one, so one rate for all would draft too much on chat or too little on a quote.

    A bucket starts at ``m / (m + 2)`` for its shortest length m: optimistic enough that a long
    match is tried when it first appears. Each verified copy draft folds in (``observe``) the
    tokens it tried and those accepted; a bucket consulted but not drafted drifts back toward
    its prior by ``relaxing`` (``relax``), so a bucket a bad stretch switched off is tried again
    after a while, at the cost of one draft."""

    smoothing: float = 0.1  # weight of one tried token
    most: float = 0.5  # the most one draft's tokens weigh together
    relaxing: float = 0.005
    rates: list[float] = field(default_factory=lambda: [CopyYield.prior(b) for b in range(COPY_BUCKETS)])

    @staticmethod
    def prior(bucket: int) -> float:
        shortest = 1 if bucket == 0 else 2 ** (bucket - 1) + 1
        return shortest / (shortest + 2)

    def rate(self, match: int) -> float:
        return self.rates[match_bucket(match)]

    def observe(self, match: int, tried: int, accepted: int) -> None:
        if tried:
            bucket = match_bucket(match)
            weight = min(self.most, self.smoothing * tried)
            self.rates[bucket] += weight * (accepted / tried - self.rates[bucket])

    def relax(self, match: int) -> None:
        bucket = match_bucket(match)
        self.rates[bucket] += self.relaxing * (self.prior(bucket) - self.rates[bucket])


def graft_outcome(tree: TokenTree, own: int, path: list[int]) -> tuple[int, int]:
    """The grafted tokens a verified tree's accepted ``path`` (root first) tried and those it
    accepted: at every node on the path with grafted children (indices ``own`` and up), one
    tried; accepted when the path goes on into one of them."""
    children = tree.children()
    tried = accepted = 0
    for depth, node in enumerate(path):
        if any(kid >= own for kid in children[node]):
            tried += 1
            accepted += depth + 1 < len(path) and path[depth + 1] >= own
    return tried, accepted


COPY_MIN_GAIN = 1.1  # how much a widened forward must beat the unwidened one (copy_width)
RATE_CAP = 0.99  # the most a copy draft counts on its next token (suffix.copy_tree)
COPY_CHECKS_LONGEST = 4  # the most steps between copy checks while none could pay, in a batch (Planner)


def copy_width(
    own: list[int],
    base: list[float],
    reach: list[tuple[float, ...]],
    cost: ForwardCost,
    limit: int,
    min_gain: float = COPY_MIN_GAIN,
) -> int:
    """The nodes per sequence (roots included) the batch's forward verifies: at least the widest
    of the trees of ``own`` sizes (expected to yield ``base`` tokens each), whose padding
    grafts fill for free, and wider only where the grafted nodes' expected tokens (each
    sequence's ``reach``, likeliest first, filling its tree from its own size) pay for the wider
    forward (``cost``): the width of most tokens per forward cost, up to ``limit``, when that
    beats both the narrowest and plain decoding by ``min_gain``: a margin over the estimates'
    noise, so that marginal drafts (open chat's short, mostly rejected matches) are not made."""
    batch, start = len(own), max(own)
    sums = [list(itertools.accumulate(r, initial=0.0)) for r in reach]

    def per_cost(width: int) -> float:
        extra = sum(s[min(len(s) - 1, max(0, width - o))] for s, o in zip(sums, own, strict=True))
        return (sum(base) + extra) / (batch * cost.growth(batch, width))

    # Past the longest tree with its grafts a wider forward only costs more.
    widest = min(limit, max(o + len(r) for o, r in zip(own, reach, strict=True)))
    best = max(range(start, max(start, widest) + 1), key=per_cost)
    return best if per_cost(best) >= min_gain * max(1.0, per_cost(start)) else start


def copies_may_widen(
    drafts: list[list[tuple[float, int]]], cost: ForwardCost, batch: int, limit: int
) -> bool:
    """Whether copy drafts could make ``copy_width`` widen a batch of ``batch`` root-only
    trees. ``drafts`` holds each sequence's candidates, (rate, depth) each: at most ``depth``
    deep, the next token right with chance ``rate``; one of them at most is grafted. A draft's
    nodes at depth d reach ``rate ** d`` together at most, so at width w a sequence adds at
    most the sum over d < w of its likeliest candidate's ``rate ** d`` among those as deep as
    d; where the batch's total never beats ``COPY_MIN_GAIN`` times the forward's growth at any
    width up to ``limit``, no width pays, and the drafts need not be built."""
    gains = [0.0] * limit  # gains[d]: what depth d adds at most, over every sequence
    for candidates in drafts:
        covered = 0  # the depths a likelier candidate already counted
        for rate, depth in sorted(candidates, reverse=True):
            q = min(rate, RATE_CAP)
            for d in range(covered + 1, min(depth, limit - 1) + 1):
                gains[d] += q**d
            covered = max(covered, depth)
    tokens = float(batch)
    for width in range(2, limit + 1):
        tokens += gains[width - 1]
        if tokens >= COPY_MIN_GAIN * batch * cost.growth(batch, width):
            return True
    return False
