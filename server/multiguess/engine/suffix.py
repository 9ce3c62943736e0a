"""Copy-source drafting: what followed the text's suffix where it occurred before.

Replies that copy their input (code edits, quotes, extraction, reformatting, an agent's
repeated tool calls) continue text that is already there. The sequence's own tokens (prompt
and output so far) and a bounded index of recent requests' outputs (``RecentOutputs``) are
searched for the longest earlier occurrence of the sequence's suffix; what followed it is the
draft, as in SuffixDecoding (arXiv 2411.04975). Where several occurrences match that long,
their continuations form a tree whose branches are weighted by how often each was seen
(``copy_tree``). The draft is as deep as the match supports (``DEPTH_PER_MATCH`` tokens per
matched token, up to the caller's depth): a 40-token verbatim match predicts the next tens of
tokens, a 2-token one barely the next. How much of it the target verifies is the engine's
choice, from each node's expected yield (``CopyDraft.reach``) against the forward's cost
(``adaptive.copy_width``). Drafting reads token lists only: it costs microseconds and its
children are deterministic, exact under any acceptance rule.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from multiguess.engine.adaptive import RATE_CAP, CopyYield
from multiguess.engine.matching import SuffixMatches, match_lengths
from multiguess.engine.tree import TokenTree
from multiguess.params import SHARED_SCOPE

# Recent outputs are searched within a scope (the engine's is ``SamplingParams.cache_scope``:
# tenant and cache_salt), so one tenant's text never steers another's drafts; callers that
# name no scope share this one.
SHARED: Hashable = SHARED_SCOPE
MAX_MATCH = 64  # matched tokens counted at most (longer matches predict no better)
DEPTH_PER_MATCH = 2  # drafted tokens per matched token, at most
MIN_SHARE = 0.1  # a branch seen in less than this share of the matches is not drafted
CANDIDATES = 64  # occurrences examined per lookup at most (the newest), bounding its time


@dataclass(frozen=True)
class Match:
    """An earlier occurrence of the suffix: ``length`` tokens of ``text`` ending at ``end``."""

    length: int
    text: Sequence[int]
    end: int

    def continuation(self, depth: int) -> tuple[int, ...]:
        return tuple(int(t) for t in self.text[self.end + 1 : self.end + 1 + depth])


class OwnText:
    """A sequence's tokens (prompt and output so far) and the earlier occurrences of its
    suffix (``matching.SuffixMatches``), kept as the sequence grows (``sync``): a step costs
    the search for its new tokens' earlier occurrences, not a copy of the sequence and a walk
    back along each match."""

    def __init__(self, max_match: int = MAX_MATCH) -> None:
        self.buffer = np.zeros(64, dtype=np.int64)
        self.size = 0
        self.found = SuffixMatches(max_match)

    @property
    def tokens(self) -> np.ndarray:
        return self.buffer[: self.size]

    def sync(self, prompt: Sequence[int], output: Sequence[int] = ()) -> None:
        """Take in what ``prompt`` and ``output`` hold past the tokens already taken in."""
        if self.size == 0:
            self._start([*prompt, *output])
            return
        for token in output[self.size - len(prompt) :]:
            self.found.advance(np.flatnonzero(self.tokens == token))
            self._put([token])

    def matches(self, limit: int = CANDIDATES) -> list[Match]:
        """Earlier occurrences of the suffix (its last token at least), each with its match
        length: the longest first, then the latest."""
        text, found = self.tokens, self.found
        return [Match(int(found.lengths[i]), text, int(found.ends[i])) for i in found.ranked(limit)]

    def _start(self, tokens: list[int]) -> None:
        self._put(tokens)
        if self.size > 1:
            text = self.tokens
            ends = np.flatnonzero(text[:-1] == text[-1])
            self.found = SuffixMatches(
                self.found.most, ends, match_lengths(text, ends, text, self.found.most)
            )

    def _put(self, tokens: Sequence[int]) -> None:
        if self.size + len(tokens) > len(self.buffer):
            grown = np.zeros(max(2 * len(self.buffer), self.size + len(tokens)), dtype=np.int64)
            grown[: self.size] = self.tokens
            self.buffer = grown
        self.buffer[self.size : self.size + len(tokens)] = tokens
        self.size += len(tokens)


def own_matches(tokens: Sequence[int], max_match: int = MAX_MATCH, limit: int = CANDIDATES) -> list[Match]:
    """Earlier occurrences in ``tokens`` of its own suffix (at least its last token), each with
    its match length (at most ``max_match``): the longest first, then the latest."""
    text = OwnText(max_match)
    text.sync(tokens)
    return text.matches(limit)


def _common_suffix(text: Sequence[int], end: int, context: Sequence[int], known: int, most: int) -> int:
    """How many tokens ending at ``text[end]`` equal the end of ``context`` (``known`` of them
    already checked), at most ``most``."""
    length, most = known, min(most, len(context), end + 1)
    while length < most and text[end - length] == context[-1 - length]:
        length += 1
    return length


@dataclass
class _Text:
    scope: Hashable
    tokens: tuple[int, ...]
    added: float


class RecentOutputs:
    """A bounded index of recent outputs, scoped: at most ``max_tokens`` tokens in all and none
    older than ``max_age`` seconds; the oldest go first. Each output is indexed by its token
    pairs (``add``), so a lookup examines only the occurrences of the context's last two."""

    def __init__(
        self, max_tokens: int = 1 << 16, max_age: float = 3600.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_tokens < 0 or max_age < 0:
            raise ValueError("the recent-output index needs max_tokens >= 0 and max_age >= 0")
        self.max_tokens, self.max_age, self.clock = max_tokens, max_age, clock
        self._texts: collections.OrderedDict[int, _Text] = collections.OrderedDict()
        self._pairs: dict[tuple[Hashable, int, int], dict[int, list[int]]] = {}
        self._ids = 0
        self.size = 0  # tokens held

    def __len__(self) -> int:
        return len(self._texts)

    def add(self, tokens: Sequence[int], scope: Hashable = SHARED) -> None:
        """Index ``tokens`` (its last ``max_tokens`` at most) under ``scope``."""
        kept = tuple(int(t) for t in tokens[len(tokens) - min(len(tokens), self.max_tokens) :])
        if len(kept) >= 2:
            self._ids += 1
            self._texts[self._ids] = _Text(scope, kept, self.clock())
            self.size += len(kept)
            for end in range(1, len(kept)):
                self._pairs.setdefault((scope, kept[end - 1], kept[end]), {}).setdefault(
                    self._ids, []
                ).append(end)
        self._expire()

    def matches(
        self,
        context: Sequence[int],
        scope: Hashable = SHARED,
        max_match: int = MAX_MATCH,
        limit: int = CANDIDATES,
    ) -> list[Match]:
        """Occurrences in the scope's outputs of ``context``'s suffix (two tokens at least), the
        newest first, at most ``limit``; each with its match length."""
        self._expire()
        if len(context) < 2:
            return []
        found: list[Match] = []
        for text_id, ends in reversed(self._pairs.get((scope, context[-2], context[-1]), {}).items()):
            text = self._texts[text_id].tokens
            for end in reversed(ends):
                found.append(Match(_common_suffix(text, end, context, 2, max_match), text, end))
                if len(found) == limit:
                    return found
        return found

    def _expire(self) -> None:
        oldest = self.clock() - self.max_age
        while self._texts and (
            self.size > self.max_tokens or next(iter(self._texts.values())).added < oldest
        ):
            text_id, text = self._texts.popitem(last=False)
            self.size -= len(text.tokens)
            for end in range(1, len(text.tokens)):
                key = (text.scope, text.tokens[end - 1], text.tokens[end])
                held = self._pairs.get(key)
                if held is not None:
                    held.pop(text_id, None)
                    if not held:
                        del self._pairs[key]


@dataclass(frozen=True)
class CopyDraft:
    """A drafted copy tree, the match it came from, and each drafted node's expected yield
    (the chance the target accepts it; tree order, which is non-increasing)."""

    tree: TokenTree
    reach: tuple[float, ...]
    match: int


def copy_tree(
    root: int, matches: list[Match], depth: int, rate: float, max_nodes: int, min_share: float = MIN_SHARE
) -> CopyDraft:
    """The tree of ``matches``' continuations (``depth`` tokens each) under ``root``, merged
    where they agree, counting how many pass through each node. A node at depth d seen in a
    share s of the matches is accepted with chance ``rate ** d * s`` (``rate``: the measured
    chance the next copied token is right); the ``max_nodes`` likeliest nodes seen in at least
    ``min_share`` of the matches are kept, likeliest first (a parent is never less likely than
    its child, so parents stay first)."""
    tokens, parents, counts, depths = [root], [-1], [len(matches)], [0]
    child: dict[tuple[int, int], int] = {}
    for match in matches:
        node = 0
        for token in match.continuation(depth):
            if (node, token) not in child:
                child[node, token] = len(tokens)
                tokens.append(token)
                parents.append(node)
                counts.append(0)
                depths.append(depths[node] + 1)
            node = child[node, token]
            counts[node] += 1
    total = max(1, len(matches))
    rate = min(rate, RATE_CAP)
    reach = [rate ** depths[i] * counts[i] / total for i in range(len(tokens))]
    order = sorted(
        (i for i in range(1, len(tokens)) if counts[i] >= min_share * total), key=lambda i: (-reach[i], i)
    )[:max_nodes]
    new = {0: 0, **{old: new for new, old in enumerate(order, start=1)}}
    tree = TokenTree((root, *(tokens[i] for i in order)), (-1, *(new[parents[i]] for i in order)))
    return CopyDraft(tree, tuple(reach[i] for i in order), matches[0].length if matches else 0)


class CopySource:
    """The copy drafts of the engine's sequences: their own text, then the recent outputs of
    their scope, and the measured yield by match length (``CopyYield``) that weighs them."""

    def __init__(self, recent: RecentOutputs | None = None, yields: CopyYield | None = None) -> None:
        self.recent = recent if recent is not None else RecentOutputs()
        self.yields = yields if yields is not None else CopyYield()

    def longest(self, text: OwnText, scope: Hashable = SHARED) -> list[Match]:
        """The earlier occurrences of ``text``'s suffix, own and recent, with the longest match
        (none when it occurred nowhere): the ones a copy draft follows."""
        found = text.matches() + self.recent.matches(text.tokens, scope)
        longest = max((m.length for m in found), default=0)
        return [m for m in found if m.length == longest]

    def draft(self, text: OwnText, depth: int, max_nodes: int, scope: Hashable = SHARED) -> CopyDraft | None:
        """The copy tree after ``text`` (at most ``depth`` deep and ``max_nodes`` nodes) from
        its longest matches; None when the suffix occurred nowhere."""
        return self.draft_from(int(text.tokens[-1]), self.longest(text, scope), depth, max_nodes)

    def draft_from(self, root: int, best: list[Match], depth: int, max_nodes: int) -> CopyDraft | None:
        """The copy tree under ``root`` from ``best`` (``longest``), shaped by ``shape``; None
        without any."""
        if not best or depth < 1 or max_nodes < 1:
            return None
        rate, reach = self.shape(best, depth)
        return copy_tree(root, best, reach, rate, max_nodes)

    def prospect(self, best: list[Match], depth: int) -> tuple[float, int] | None:
        """The ``shape`` of the tree ``draft_from`` would make from ``best``, or None where it
        would keep no node below its root: what the planner weighs before building any."""
        if not best or depth < 1 or not drafts_nodes(best):
            return None
        return self.shape(best, depth)

    def shape(self, best: list[Match], depth: int) -> tuple[float, int]:
        """The measured chance that ``best``'s next token is right, and the depth of their
        tree: ``DEPTH_PER_MATCH`` tokens per matched token, at most ``depth``."""
        length = best[0].length
        return self.yields.rate(length), min(depth, DEPTH_PER_MATCH * length)

    def record(self, output: Sequence[int], scope: Hashable = SHARED) -> None:
        """A finished sequence's output, for later requests of ``scope`` to copy from."""
        self.recent.add(output, scope)


def drafts_nodes(best: list[Match], min_share: float = MIN_SHARE) -> bool:
    """Whether ``copy_tree`` over ``best`` keeps any node below its root: some next token is
    seen in at least ``min_share`` of them (a deeper node is never seen more often than its
    parent)."""
    firsts = collections.Counter(m.continuation(1) for m in best)
    firsts.pop((), None)
    return bool(firsts) and max(firsts.values()) >= min_share * max(1, len(best))
