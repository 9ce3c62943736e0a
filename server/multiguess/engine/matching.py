"""Suffix matching: where a text holds the end of a token stream, and how long each match is.

Copy drafts (``suffix.py``: a sequence's own text), predicted outputs (``prediction.py``: the
prediction against the output) and the n-gram drafter (``ngram.py``) all ask it. Measured once
(``match_lengths``), a match walks back along the stream, one comparison of the candidates
per token; kept as the stream grows (``SuffixMatches``), each new token extends the matches
its occurrences continue, so a decoding step costs one search among them whatever the
matches' length.
"""

from __future__ import annotations

import numpy as np

EMPTY = np.zeros(0, dtype=np.int64)


def match_lengths(text: np.ndarray, ends: np.ndarray, tail: np.ndarray, most: int) -> np.ndarray:
    """For each position in ``ends`` (where ``text`` holds ``tail``'s last token), how many
    tokens ending there equal the end of ``tail``, at most ``most``."""
    lengths = np.ones(len(ends), dtype=np.int64)
    alive = np.arange(len(ends))
    for back in range(1, min(most, len(tail))):
        alive = alive[ends[alive] >= back]
        alive = alive[text[ends[alive] - back] == tail[-1 - back]]
        if not alive.size:
            break
        lengths[alive] += 1
    return lengths


class SuffixMatches:
    """The occurrences in a text of a stream's suffix (``ends``, ascending) and each one's
    length (``lengths``, at most ``most``), kept as the stream grows: a token the stream gains
    extends by one the matches whose next text token it is and starts a match at its other
    occurrences (``advance``)."""

    def __init__(self, most: int, ends: np.ndarray = EMPTY, lengths: np.ndarray = EMPTY) -> None:
        self.most, self.ends, self.lengths = most, ends, lengths

    def advance(self, positions: np.ndarray) -> None:
        """The stream gained a token, which the text holds at ``positions`` (ascending)."""
        before = positions - 1
        prior = np.zeros(len(positions), dtype=np.int64)
        if len(self.ends) and len(positions):
            i = np.minimum(np.searchsorted(self.ends, before), len(self.ends) - 1)
            hit = self.ends[i] == before
            prior[hit] = self.lengths[i[hit]]
        self.ends, self.lengths = positions, np.minimum(prior + 1, self.most)

    def ranked(self, limit: int) -> np.ndarray:
        """Indices into ``ends`` of at most ``limit`` matches, the longest first, then the latest."""
        return np.lexsort((-self.ends, -self.lengths))[:limit]
