"""Suffix matching: where a text holds the end of a token stream, and how long each match is.

Copy drafts (``suffix.py``: a sequence's own text), predicted outputs (``prediction.py``: the
prediction against the output) and the n-gram drafter (``ngram.py``) all ask it. Measured once
(``match_lengths``), a match walks back along the stream, one comparison of the candidates
per token; kept as the stream grows (``SuffixMatches``), each new token extends the matches
its occurrences continue, so a decoding step costs a look-up of its token's occurrences
(``Occurrences``) and one dictionary probe per occurrence, whatever the matches' length: in
plain Python, which at a token's few occurrences beats numpy's per-call cost several-fold.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import numpy as np


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


class Occurrences:
    """Where each token occurs in a growing text, in ascending order (``add`` appends)."""

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.size = 0
        self.at: dict[int, list[int]] = {}
        self.add(tokens)

    def add(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.at.setdefault(int(token), []).append(self.size)
            self.size += 1

    def of(self, token: int) -> list[int]:
        return self.at.get(int(token), [])


class SuffixMatches:
    """The occurrences in a text of a stream's suffix, by where each ends (ascending: ``by_end``
    maps it to the match's length, at most ``most``), kept as the stream grows: a token the
    stream gains extends by one the matches whose next text token it is and starts a match at
    its other occurrences (``advance``)."""

    def __init__(self, most: int, ends: Iterable[int] = (), lengths: Iterable[int] = ()) -> None:
        self.most = most
        self.by_end = dict(zip(map(int, ends), map(int, lengths), strict=True))

    def advance(self, positions: Iterable[int]) -> None:
        """The stream gained a token, which the text holds at ``positions`` (ascending)."""
        prior, most = self.by_end, self.most
        self.by_end = {p: min(prior.get(p - 1, 0) + 1, most) for p in positions}

    def ranked(self, limit: int) -> list[tuple[int, int]]:
        """At most ``limit`` matches as (end, length), the longest first, then the latest."""
        return heapq.nsmallest(limit, self.by_end.items(), key=lambda match: (-match[1], -match[0]))
