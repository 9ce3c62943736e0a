"""The target's verification forwards as they run: the cost curve the policy reads, kept true.

``measure_forward_cost`` times the target once, before any request runs. A forward's time then
drifts with the machine (a slow stretch of a shared machine slows wide forwards more than
narrow ones), and batches of short rows per sequence cost more than one chain of as many.
Priced by the start's curve alone, copy drafts that looked worth a wider forward made batches
slower than plain decoding (docs/ENGINE.md). So every verification forward's time is kept
against the curve, and the curve is refitted to the recent ones now and then: rarely enough
that plans, which are cached on the curve, are rarely remade.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import statistics
from dataclasses import dataclass, field, replace

from multiguess.engine.adaptive import ForwardCost, without_attention

REFIT_EVERY = 128  # verification forwards between refits of the curve
WINDOW = 64  # the latest forwards kept per curve point
LEAST = 8  # the fewest forwards near a point that move it


@dataclass
class ForwardTimes:
    """Recent verification forwards against the curve ``measured`` at start. Each forward's
    seconds, less the attention the curve prices for its sequences, over the curve's time for
    its tokens, is kept at the curve point nearest its tokens (on a log scale). Every ``every``
    forwards each point becomes its measured time times the median of its latest ratios; a
    point with fewer than ``least`` takes the nearest point's that has them (so a batch that
    never drafts still moves the whole curve with the machine, and a wider forward it then
    drafts corrects its own point); the curve is then made non-decreasing again."""

    measured: ForwardCost
    every: int = REFIT_EVERY
    window: int = WINDOW
    least: int = LEAST
    ratios: list[collections.deque[float]] = field(init=False)
    count: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.ratios = [collections.deque(maxlen=self.window) for _ in self.measured.tokens]

    def record(self, sequences: list[tuple[int, int]], seconds: float) -> ForwardCost | None:
        """Keep a forward of ``sequences`` (rows and cached tokens each) that took ``seconds``;
        every ``every`` forwards, the refitted curve (None otherwise, or while no point has
        ``least`` forwards)."""
        curve, tokens = self.measured, sum(rows for rows, _ in sequences)
        attention = sum(curve.attended(rows, context) for rows, context in sequences)
        self.ratios[self._nearest(tokens)].append(without_attention(seconds, attention) / curve(tokens))
        self.count += 1
        return self._refitted() if self.count % self.every == 0 else None

    def _nearest(self, tokens: int) -> int:
        """The index of the curve point nearest ``tokens`` on a log scale: of the two around it,
        the upper one where ``tokens`` is past their geometric mean."""
        points = self.measured.tokens
        i = bisect.bisect_left(points, tokens)
        if i == len(points):
            return i - 1
        return i if i == 0 or tokens * tokens > points[i - 1] * points[i] else i - 1

    def _refitted(self) -> ForwardCost | None:
        known = {i: statistics.median(r) for i, r in enumerate(self.ratios) if len(r) >= self.least}
        if not known:
            return None
        scale = [known[min(known, key=lambda k: (abs(k - i), k))] for i in range(len(self.ratios))]
        seconds = itertools.accumulate(
            (s * r for s, r in zip(self.measured.seconds, scale, strict=True)), max
        )
        return replace(self.measured, seconds=tuple(seconds))
