"""What a step costs by the tokens its forward verifies: timed at start, calibrated by real steps.

The planner prices trees by a ``ForwardCost`` curve. At start only the bare forward can be timed,
on chains after a few contexts (``timing.measure_forward_cost``; ``ContextCurves`` reads them at
any context). A real step costs more, and its growth with the tokens differs: planning,
acceptance and emitting come on top of the forward. Priced by the start curves alone, trees whose
steps cost more than the tokens they bring looked as if they paid (docs/ENGINE.md).

``StepCosts`` keeps, for every count of tokens a real step's forward verified, the latest ratios
of that step's seconds (its drafting left out: ``adaptive.CostMeter`` prices that) to the start
curves' at that count and that step's context. The curve the planner reads at a context is the
start curves' there, scaled by the median ratio of each count measured (``scaled``). Ratios are
read to ``PLAN_DIGITS`` and contexts in steps of ``CONTEXT_STEP``, so the curve, and the plans
cached on it, change only when what steps cost does.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from multiguess.engine.adaptive import PLAN_DIGITS, ForwardCost

CONTEXT_STEP = 64  # tokens of context a curve is read for at a time


@dataclass(frozen=True)
class ContextCurves:
    """Forward-cost curves timed after each of ``contexts`` (ascending). After another context,
    each count's seconds follow the line through the two nearest (attention grows linearly with
    the context), held at the shortest below it."""

    contexts: tuple[int, ...]
    curves: tuple[ForwardCost, ...]

    @classmethod
    def flat(cls, curve: ForwardCost) -> ContextCurves:
        """``curve`` after any context."""
        return cls((0,), (curve,))

    def at(self, context: int) -> ForwardCost:
        if len(self.curves) == 1:
            return self.curves[0]
        context = max(context, self.contexts[0])
        i = min(max(bisect.bisect_left(self.contexts, context), 1), len(self.contexts) - 1)
        (c0, c1), (low, high) = self.contexts[i - 1 : i + 1], self.curves[i - 1 : i + 1]
        share = (context - c0) / (c1 - c0)
        points = sorted({*low.tokens, *high.tokens})
        seconds = (low(n) + share * (high(n) - low(n)) for n in points)
        return ForwardCost(tuple(points), tuple(itertools.accumulate(seconds, max)))


@dataclass
class StepCosts:
    """The start curves (``start``) and what real steps cost against them. Without
    ``calibrating`` (an engine whose trees are fixed, or curves set by hand) the start curves
    are the curves."""

    start: ContextCurves
    calibrating: bool = True
    window: int = 31  # a count's latest steps its ratio is the median of
    min_samples: int = 3  # steps of a count before its ratio counts
    spacing: int = 8  # steps between the plain steps measured first (``plain_due``)
    refresh: int = 128  # steps between plain steps measured after those
    ratios: dict[int, collections.deque[float]] = field(default_factory=dict, init=False)
    steps: int = field(default=0, init=False)  # steps observed
    last: dict[int, int] = field(default_factory=dict, init=False)  # each count's latest step
    _factors: tuple[tuple[int, float], ...] = field(default=(), init=False)
    _starts: dict[int, ForwardCost] = field(default_factory=dict, init=False)  # by context read
    _curves: dict[int, ForwardCost] = field(default_factory=dict, init=False)  # the same, scaled
    _stale: bool = field(default=False, init=False)

    @classmethod
    def fixed(cls, curve: ForwardCost) -> StepCosts:
        """``curve`` whatever the context and the steps."""
        return cls(ContextCurves.flat(curve), calibrating=False)

    def observe(self, tokens: int, context: int, seconds: float) -> None:
        """A real step whose forward verified ``tokens`` after ``context`` cached tokens (the
        batch's mean) took ``seconds`` besides drafting."""
        if not self.calibrating or tokens < 1 or seconds <= 0:
            return
        window = self.ratios.setdefault(tokens, collections.deque(maxlen=self.window))
        window.append(seconds / self._start(context)(tokens))
        self.steps += 1
        self.last[tokens] = self.steps
        self._stale = True

    def plain_due(self, batch: int) -> bool:
        """Whether a plain step of ``batch`` sequences (one token each) should be measured: none
        was in the latest ``spacing`` steps while it has fewer than ``min_samples``, or in the
        latest ``refresh`` after. Every tree is priced against the plain step, and while trees
        or copies are drafted every step none is made unless asked for; spaced apart, because
        the first steps after a long prefill run slower than the rest."""
        if not self.calibrating:
            return False
        if batch not in self.last:
            return True
        enough = len(self.ratios[batch]) >= self.min_samples
        return self.steps - self.last[batch] >= (self.refresh if enough else self.spacing)

    def curve(self, context: int) -> ForwardCost:
        """The curve to plan with after ``context`` cached tokens (the batch's mean): the start
        curves' there until some count has ``min_samples`` steps."""
        if self._stale:
            self._stale = False
            factors = tuple(
                (tokens, round(statistics.median(ratios), PLAN_DIGITS))
                for tokens, ratios in sorted(self.ratios.items())
                if len(ratios) >= self.min_samples
            )
            if factors != self._factors:
                self._factors = factors
                self._curves.clear()
        read = context // CONTEXT_STEP
        curve = self._curves.get(read)
        if curve is None:
            curve = self._curves[read] = scaled(self._start(context), self._factors)
        return curve

    def _start(self, context: int) -> ForwardCost:
        read = context // CONTEXT_STEP
        start = self._starts.get(read)
        if start is None:
            start = self._starts[read] = self.start.at(read * CONTEXT_STEP)
        return start


def scaled(start: ForwardCost, factors: Sequence[tuple[int, float]]) -> ForwardCost:
    """``start`` with each count's seconds times its factor: ``factors`` holds (count, factor)
    pairs by count; between two counts the factor is interpolated, beyond them the nearest is
    held. The result is made non-decreasing (more tokens never cost less)."""
    if not factors:
        return start
    counts, values = zip(*factors, strict=True)

    def factor(tokens: int) -> float:
        i = bisect.bisect_left(counts, tokens)
        if i == 0:
            return values[0]
        if i == len(counts):
            return values[-1]
        (t0, t1), (f0, f1) = counts[i - 1 : i + 1], values[i - 1 : i + 1]
        return f0 + (f1 - f0) * (tokens - t0) / (t1 - t0)

    points = sorted({*start.tokens, *counts})
    seconds = itertools.accumulate((start(tokens) * factor(tokens) for tokens in points), max)
    return ForwardCost(tuple(points), tuple(seconds))
