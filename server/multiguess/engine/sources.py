"""Which drafting source each sequence drafts from this step (a pure policy).

A sequence has up to three sources: the draft model's tree (a model or EAGLE-3 drafter, priced
by its measured coverage and draft time, ``adaptive``), its prediction's continuation and the
continuation of its suffix where it occurred before (copy drafts, ``prediction.py`` and
``suffix.py``, priced by their measured yield by match length, ``adaptive.CopyYield``). Each is
worth the tokens one verification of it is expected to yield per plain step it costs; the
forward's cost is read from the measured curve (``adaptive.ForwardCost``).

Where a copy draft is worth at least the model's tree, the model does not draft for that
sequence: a long reliable match already covers what the model would guess, and the model's
draft forwards and its extra rows would be paid for tokens the copy brings anyway. The copy is
then verified alone, as deep as its yield pays for (``adaptive.copy_width``). Of two copy
drafts (a prediction and a suffix match) the one worth more is grafted.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from multiguess.engine.adaptive import ForwardCost


def copy_worth(reach: Sequence[float], cost: ForwardCost, batch: int, limit: int) -> float:
    """Tokens per plain step of a copy draft verified alone (``reach``: each node's expected
    yield, likeliest first): the best over its first n nodes (roots included, at most ``limit``)
    of ``1 + sum(reach[:n - 1])`` tokens for a forward of n nodes per sequence of ``batch``."""
    sums = itertools.accumulate(reach[: max(0, limit - 1)], initial=0.0)
    return max((1 + total) / cost.growth(batch, nodes) for nodes, total in enumerate(sums, start=1))


def model_worth(
    tokens: float, nodes: int, levels: int, cost: ForwardCost, batch: int, fixed: float, per_level: float
) -> float:
    """Tokens per plain step of a model tree of ``nodes`` drafted nodes over ``levels`` levels
    expected to yield ``tokens``: its forward's growth plus the draft's fixed and per-level cost
    (``adaptive.CostMeter.ratios``)."""
    return tokens / (cost.growth(batch, 1 + nodes) + fixed + levels * per_level)


def better_copy(worths: Sequence[float | None]) -> int | None:
    """The index of the copy draft worth most (None: there is none)."""
    found = [(worth, i) for i, worth in enumerate(worths) if worth is not None]
    return max(found, key=lambda f: (f[0], -f[1]))[1] if found else None


def model_drafts(copy: float | None, model: float) -> bool:
    """Whether the model drafts beside a copy draft worth ``copy`` (None: there is none): only
    where its tree is worth more."""
    return copy is None or model > copy
