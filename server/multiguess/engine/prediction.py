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
from multiguess.engine.matching import SuffixMatches
from multiguess.engine.suffix import MAX_MATCH, CopyDraft, Match, copy_tree

# The match length a prediction's beginning counts as before any output: the client's word
# that the reply starts so is worth a few matched tokens, and a wrong one costs one draft.
START = 8


class Alignment:
    """A request's prediction and the occurrences in it of its output's suffix
    (``matching.SuffixMatches``), kept as the output grows (``sync``), and where the output was
    last aligned (``anchor``)."""

    def __init__(self, prediction: np.ndarray, max_match: int = MAX_MATCH) -> None:
        self.prediction = prediction
        self.found = SuffixMatches(max_match)
        self.seen = 0  # output tokens taken in
        self.anchor = 0

    def sync(self, output: Sequence[int]) -> None:
        """Take in what ``output`` holds past the tokens already taken in."""
        for token in output[self.seen :]:
            self.found.advance(np.flatnonzero(self.prediction == token))
        self.seen = len(output)

    def match(self) -> Match | None:
        """Where the output continues in the prediction: the longest occurrence there of the
        output's suffix with a token after it, of those the nearest at or after ``anchor`` first,
        then the nearest before it; the beginning when there is no output yet; None when the
        output's last token occurs nowhere in the prediction but at its end."""
        prediction = self.prediction
        if not self.seen:
            return Match(START, prediction, -1)
        usable = self.found.ends < len(prediction) - 1
        if not usable.any():
            return None
        ends, lengths = self.found.ends[usable], self.found.lengths[usable]
        longest = lengths == lengths.max()
        anchor = self.anchor
        distance = np.where(ends >= anchor, ends - anchor, len(prediction) + anchor - ends)
        best = np.flatnonzero(longest)[np.argmin(distance[longest])]
        return Match(int(lengths[best]), prediction, int(ends[best]))

    def locate(self) -> Match | None:
        """``match``, and the anchor moves to where its continuation starts: the draft from
        there is this step's, and the next alignment looks at or after it first."""
        found = self.match()
        if found is not None:
            self.anchor = found.end + 1
        return found


def align(
    prediction: np.ndarray, output: Sequence[int], anchor: int, max_match: int = MAX_MATCH
) -> Match | None:
    """Where ``output`` continues in ``prediction`` after the last alignment's end ``anchor``
    (``Alignment.match``)."""
    alignment = Alignment(prediction, max_match)
    alignment.sync(output)
    alignment.anchor = anchor
    return alignment.match()


def prediction_draft(root: int, match: Match | None, depth: int, yields: CopyYield) -> CopyDraft | None:
    """The chain of the prediction's next tokens after ``match`` (``Alignment.locate``), at most
    ``depth``, each level accepted with the chance ``yields`` measured for its match length.
    None without a match: the output's last token is nowhere in the prediction, or the
    prediction is used up there."""
    if match is None or depth < 1:
        return None
    return copy_tree(root, [match], depth, yields.rate(match.length), depth)


def prediction_prospect(match: Match, depth: int, yields: CopyYield) -> tuple[float, int] | None:
    """The chance the next token of ``prediction_draft``'s chain is right, and its depth,
    without building it (None: no chain): what the planner weighs first (as
    ``CopySource.prospect``)."""
    if depth < 1:
        return None
    return yields.rate(match.length), min(depth, len(match.text) - match.end - 1)
