"""Predicted outputs: drafts from the text the client expects the reply to be.

A client that edits a file sends the file as OpenAI's ``prediction``; most of the reply is the
file again, with a few edits. The draft is the prediction's continuation at the place the
output so far aligns with it: at first its beginning; while the output agrees, the next
predicted tokens; after a divergence (an edit), the place where the output's latest tokens
occur in the prediction again, the nearest one at or after the last alignment first (edits
keep the file's order), as speculative-edit systems re-anchor rather than give up. The
draft's depth and how much of it is verified are the engine's copy policy's (``suffix.py``,
``adaptive.copy_width``), with yields measured for predictions apart.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from multiguess.engine.adaptive import CopyYield
from multiguess.engine.suffix import MAX_MATCH, CopyDraft, Match, copy_tree

# The match length a prediction's beginning counts as before any output: the client's word
# that the reply starts so is worth a few matched tokens, and a wrong one costs one draft.
START = 8


def align(
    prediction: np.ndarray, output: Sequence[int], anchor: int, max_match: int = MAX_MATCH
) -> Match | None:
    """Where ``output`` (the reply so far) continues in ``prediction``: the longest occurrence
    there of the output's suffix, of those the nearest at or after ``anchor`` (the last
    alignment's end) first, then the nearest before it; the beginning when there is no output
    yet; None when the output's last token occurs nowhere in the prediction."""
    if not output:
        return Match(START, prediction, -1)
    tail = np.asarray(output[-max_match:])
    ends = np.flatnonzero(prediction[: len(prediction) - 1] == tail[-1])
    if not ends.size:
        return None
    lengths = np.ones(len(ends), dtype=np.int64)
    alive = np.arange(len(ends))
    for back in range(1, len(tail)):
        alive = alive[ends[alive] >= back]
        alive = alive[prediction[ends[alive] - back] == tail[-1 - back]]
        if not alive.size:
            break
        lengths[alive] += 1
    longest = lengths == lengths.max()
    distance = np.where(ends >= anchor, ends - anchor, len(prediction) + anchor - ends)
    best = np.flatnonzero(longest)[np.argmin(distance[longest])]
    return Match(int(lengths[best]), prediction, int(ends[best]))


def prediction_draft(
    root: int, prediction: np.ndarray, output: Sequence[int], anchor: int, depth: int, yields: CopyYield
) -> tuple[CopyDraft, int] | None:
    """The chain of the prediction's next tokens after ``output`` (at most ``depth``), each
    level accepted with the chance ``yields`` measured for its match length, and the
    alignment's next position (the next step's ``anchor``); None when the output's last token
    is nowhere in the prediction or the prediction is used up there."""
    match = align(prediction, output, anchor)
    if match is None or match.end + 1 >= len(prediction) or depth < 1:
        return None
    return copy_tree(root, [match], depth, yields.rate(match.length), depth), match.end + 1
