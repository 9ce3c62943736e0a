"""Drafters propose token trees; the engine verifies them with the target.

The interface is three calls: ``propose`` a tree per sequence, ``commit`` what the target
accepted (so a stateful drafter can keep its cache in step), ``release`` a sequence's state;
``move`` follows a sequence to another slot, and ``observe`` measures the drafter against tokens
the target already chose, where it can do that without a tree. For prefix reuse
(``engine/prefix_cache.py``) a finished sequence is ``retain``-ed instead of released, and a
new sequence starts with ``share``: from what a slot holds of its first tokens.
A drafter that raises never fails a request: the engine decodes that step with the target
alone and calls ``release`` so the drafter starts that sequence afresh.

A drafter that reads the target's hidden states (EAGLE-3, ``engine/eagle3.py``) names the
layers in ``feature_layers``; the engine then has its target forwards capture them and hands
them over with ``add_features(slot, position, features)``: the prompt's after prefill, the
accepted path's after every verification, so they flow into the next proposal.

A drafter whose ``takes_grafts`` is true lets the engine graft copy drafts (``engine/suffix.py``)
onto its greedy and seeded trees after the drafter's own (``Proposal.drafted``); one whose
``copy_only`` is true (the suffix drafter) is not asked for trees: its trees are those grafts.

A drafter with ``prefill(slot, token_ids)`` catches up on a prompt while the target prefills
it, chunk by chunk under ``EngineConfig.max_prefill_tokens``; one without catches up at its
first proposal, on the whole prompt at once.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from multiguess.engine.acceptance import Acceptance
from multiguess.engine.grammar import GrammarState
from multiguess.engine.padding import padded_groups
from multiguess.engine.prefix_cache import swap_keys
from multiguess.engine.runner import NativeRunner
from multiguess.engine.sampling import (
    Generators,
    Processing,
    draw_without_replacement,
    processed_probs,
    race_top,
)
from multiguess.engine.tree import TokenTree

# A seeded sample's children race over each row's likeliest columns only: a token beyond them
# rarely wins, and a tree need only be a good guess, since the seed alone fixes the output.
RACED = 64


@dataclass(frozen=True)
class TreeBudget:
    """``num_candidates`` children per expanded node and beam width per level; ``depth`` levels;
    ``max_nodes`` drafted nodes at most (the root not counted)."""

    num_candidates: int = 3
    depth: int = 4
    max_nodes: int = 16

    def __post_init__(self) -> None:
        if self.num_candidates < 1:
            raise ValueError(f"num_candidates must be at least 1, got {self.num_candidates}")
        if self.depth < 0:
            raise ValueError(f"depth must be >= 0, got {self.depth}")
        if self.max_nodes < 1:
            raise ValueError(f"max_nodes must be at least 1, got {self.max_nodes}")

    @property
    def slack(self) -> int:
        """Cache room past a sequence's end for such a tree (and a drafter's level-by-level region)."""
        return max(self.max_nodes, self.num_candidates * self.depth) + 2


@dataclass
class DraftRequest:
    slot: int
    token_ids: list[int]  # the whole sequence; its last token is the tree's root
    budget: TreeBudget
    # Processes draft logits into the distribution children are *sampled* from; None means the
    # deterministic top-k children (greedy requests).
    sample: SampleSpec | None = None
    # Structured output: drafted children are only tokens the grammar allows at their parent.
    grammar: GrammarState | None = None


@dataclass
class SampleSpec:
    processing: Processing
    generators: Generators
    # A seeded request: its children win the draft's race under the noise its target draws with
    # (``acceptance.SeededChoices``), not independent draws.
    coupled: bool = False


@dataclass
class Proposal:
    tree: TokenTree
    # For sampled children: node index -> the distribution its children were drawn from.
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)
    # How many of the tree's first nodes the drafter drafted (None: all); the rest were
    # grafted on as copy drafts (``ngram.graft``), which say nothing of the drafter's coverage.
    drafted: int | None = None
    # The match length of the grafted copy draft (``engine/suffix.py``; 0: none), whose
    # outcome the copy policy measures by it.
    copy_match: int = 0
    predicted: bool = False  # the grafted nodes follow the request's prediction, not a copy

    @property
    def own_nodes(self) -> int:
        """The tree's first nodes, the root included, that the drafter drafted."""
        return len(self.tree) if self.drafted is None else self.drafted

    @property
    def drafted_depth(self) -> int:
        """The levels the drafter drafted (grafted nodes may reach deeper)."""
        return max(self.tree.depths[: self.own_nodes])

    def drafted_part(self, path: list[int]) -> tuple[TokenTree, list[int]]:
        """The tree of the drafter's own nodes and the part of ``path`` (root first) in it."""
        if self.drafted is None:  # nothing grafted: no copy on every step of every sequence
            return self.tree, path
        n = self.drafted
        own = TokenTree(self.tree.tokens[:n], self.tree.parents[:n])
        return own, list(itertools.takewhile(lambda node: node < n, path))


class Drafter(Protocol):
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]: ...

    def commit(self, slot: int, proposal: Proposal, acceptance: Acceptance) -> None: ...

    def release(self, slot: int) -> None: ...

    def retain(self, slot: int, length: int) -> None:
        """The sequence in ``slot`` finished: keep what the drafter holds of its first ``length``
        tokens for a later sequence that starts with them (``share``); 0 is ``release``."""
        ...

    def share(self, src: int, dst: int, length: int) -> int:
        """A new sequence in ``dst`` starts with the first ``length`` tokens of the sequence held
        in ``src`` (running or retained; ``dst`` itself: in place): take what the drafter holds
        of them, drop the rest of ``dst``'s state, and return how many of those tokens the
        target may skip computing (at most ``length``; fewer when the drafter needs the
        target's forward over some of them, as EAGLE-3 needs their features)."""
        ...

    def move(self, src: int, dst: int) -> None:
        """The sequence in slot ``src`` now runs in the free slot ``dst``, and what ``dst``
        retained is retained in ``src`` now (the two slots swap)."""
        ...

    def observe(
        self, slot: int, token_ids: list[int], width: int, since: int, sample: SampleSpec | None = None
    ) -> list[int | None] | None:
        """The rank of each ``token_ids[i]``, ``i >= since``, whose guess the drafter had not made
        yet (it had not seen ``token_ids[i - 1]``) among its ``width`` best guesses there (None:
        not among them), in order; None when the drafter cannot tell without drafting a tree.
        ``sample``: a seeded sample's, whose guesses are its race's winners (``coupled``)."""
        ...


class StatelessDrafter:
    """The calls a drafter that keeps nothing per sequence (it proposes from the sequence's own
    text) answers with nothing: subclasses write ``propose`` alone."""

    def commit(self, slot: int, proposal: Proposal, acceptance: Acceptance) -> None:
        """Nothing to keep."""

    def release(self, slot: int) -> None:
        """Nothing to free."""

    def retain(self, slot: int, length: int) -> None:
        """Nothing to keep."""

    def share(self, src: int, dst: int, length: int) -> int:
        """Nothing to share: the target may skip every shared token."""
        return length

    def move(self, src: int, dst: int) -> None:
        """Nothing to move."""

    def observe(
        self, slot: int, token_ids: list[int], width: int, since: int, sample: SampleSpec | None = None
    ) -> None:
        """None, it cannot tell: what it would have guessed depends on where the text repeated
        itself, so probe trees (or the engine's copy policy) measure it."""


def seeded_guesses(
    dists: torch.Tensor,
    seed: int,
    positions: list[int],
    tokens: Callable[[torch.Tensor], torch.Tensor],
    count: int,
) -> torch.Tensor:
    """The ``count`` columns of each row of ``dists`` (a drafter's processed distributions over
    its columns, whose token ids ``tokens`` gives) that win a seeded sample's race under the
    noise of the row's position, raced over the rows' ``RACED`` likeliest columns: one race for
    all rows (``sampling.race_top``). Columns past a row's support can end a row."""
    likeliest = torch.topk(dists, min(RACED, dists.shape[-1]), dim=-1).indices.unique()
    return likeliest[race_top(dists[:, likeliest], seed, positions, tokens(likeliest), count)]


def _path(cands: list[_Candidate], index: int) -> tuple[int, ...]:
    """The drafted tokens from the root down to candidate ``index`` (-1, the root: none)."""
    tokens = []
    while index != -1:
        tokens.append(cands[index].token)
        index = cands[index].parent
    return tuple(reversed(tokens))


@dataclass
class _Candidate:
    """A drafted node before the final selection (``index`` is its order of creation)."""

    token: int
    parent: int  # candidate index, -1 for children of the root
    score: float  # cumulative draft log-probability
    sibling_rank: int  # order among its siblings (draw order when sampled)
    spine: bool = False  # on the chain of first children: what chain speculation would draft
    depth: int = 1  # levels below the root
    sees: tuple[int, ...] = ()  # once fed to the draft: region offsets of its ancestors and itself


def select_nodes(candidates: list[_Candidate], max_nodes: int) -> list[int]:
    """Best-first choice of at most ``max_nodes`` candidates by cumulative log-probability.

    The spine (the chain of first children) comes first, so a tree never verifies less than
    chain speculation would. Any other candidate is eligible once its parent and its previous
    sibling are chosen: the tree stays connected, and sampled siblings stay a prefix of their
    draw order, which exact sampling without replacement requires. Returned in creation order
    (parents before children).
    """
    first_child: dict[int, int] = {}
    next_sibling: dict[int, int] = {}
    last_of: dict[int, int] = {}
    for i, cand in sorted(enumerate(candidates), key=lambda ic: (ic[1].parent, ic[1].sibling_rank)):
        if cand.parent in last_of:
            next_sibling[last_of[cand.parent]] = i
        else:
            first_child[cand.parent] = i
        last_of[cand.parent] = i
    chosen = [i for i, c in enumerate(candidates) if c.spine][:max_nodes]
    taken = set(chosen)
    heap: list[tuple[float, int]] = []

    def offer(i: int | None) -> None:
        if i is not None and i not in taken:
            heapq.heappush(heap, (-candidates[i].score, i))

    for i in [-1, *chosen]:
        offer(first_child.get(i))
        offer(next_sibling.get(i))
    while heap and len(chosen) < max_nodes:
        _, i = heapq.heappop(heap)
        if i in taken:
            continue
        chosen.append(i)
        taken.add(i)
        offer(first_child.get(i))
        offer(next_sibling.get(i))
    return sorted(chosen)


class ModelDrafter:
    """Grows a tree with a small causal LM: one batched draft forward per tree level.

    Per level, every beam node gets its ``num_candidates`` best (or sampled) children; the
    spine child and the children with the highest cumulative log-probability, ``num_candidates``
    in all, form the next beam. At the end the best ``max_nodes`` nodes form the tree. The
    draft keeps its own KV cache: the sequence's tokens it has not seen yet are fed as a chain
    first (usually the root and a token or two accepted last step), beam nodes are written
    after them and only the accepted ones are kept.
    """

    # Its commit keeps the draft KV of the accepted nodes it fed and its next proposal catches
    # up on the rest, so the engine may graft copy drafts onto its trees.
    takes_grafts = True

    def __init__(self, runner: NativeRunner) -> None:
        self.runner = runner
        # The token of each logit column when the draft scores only its vocabulary: drafting
        # then ranks and samples over those columns alone, 6x fewer for the embedded draft.
        self.vocab = runner.head_vocab
        self.cached: dict[int, int] = {}  # slot -> how many of the sequence's tokens are cached
        self._fed: dict[int, tuple[int, dict[int, int]]] = {}  # slot -> (prefix, node -> offset)

    def release(self, slot: int) -> None:
        self.cached.pop(slot, None)
        self._fed.pop(slot, None)
        self.runner.cache.truncate(slot, 0)

    def retain(self, slot: int, length: int) -> None:
        """Keep the draft cache of the sequence's first ``length`` tokens (those it has seen)."""
        self._fed.pop(slot, None)
        self.cached[slot] = min(self.cached.get(slot, 0), length)
        self.runner.cache.truncate(slot, self.cached[slot])

    def share(self, src: int, dst: int, length: int) -> int:
        """The draft cache of ``src``'s first ``length`` tokens (those it has seen) in ``dst``;
        the catch-up feeds the rest, so the target may skip all ``length``."""
        held = min(self.cached.get(src, 0), length)
        self.release(dst)
        if src != dst:
            self.runner.cache.move(src, dst, held)
        self.cached[dst] = held
        return length

    def move(self, src: int, dst: int) -> None:
        """Carry the sequence's draft cache along (a catch-up from scratch would re-read it all)
        and what ``dst`` retained back to ``src``."""
        self.runner.cache.exchange(src, dst, self.cached.get(src, 0), self.cached.get(dst, 0))
        for state in (self.cached, self._fed):
            swap_keys(state, src, dst)

    def prefill(self, slot: int, token_ids: list[int]) -> None:
        """Feed what the draft has not seen of ``token_ids[:-1]``, the part of a prompt the
        target has just cached (its last token is the target's next one)."""
        start, end = self.cached.get(slot, 0), len(token_ids) - 1
        if start < end:
            self.runner.forward_trees(
                [slot], [start], [TokenTree.chain(token_ids[start:end])], last_only=True
            )
            self.cached[slot] = end

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        logits, prefixes = self._catch_up(requests)
        return self._grow(requests, logits, prefixes)

    def _catch_up(self, requests: list[DraftRequest]) -> tuple[torch.Tensor, list[int]]:
        """Feed each sequence's tokens the draft has not seen, as a chain: the root's logits
        ``[B, V]``, and where each sequence's tree region starts in the draft's cache."""
        slots = [r.slot for r in requests]
        starts = [self.cached.get(r.slot, 0) for r in requests]
        chunks = [TokenTree.chain(r.token_ids[s:]) for r, s in zip(requests, starts, strict=True)]
        rooms = [self.runner.capacity - s for s in starts]
        groups = padded_groups([len(c) for c in chunks], self.runner.capacity, rooms)  # runs, in order
        parts = [
            self.runner.forward_trees(
                [slots[i] for i in g], [starts[i] for i in g], [chunks[i] for i in g], last_only=True
            )
            for g in groups
        ]
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)  # one run, the usual step: no copy
        prefixes = [len(r.token_ids) for r in requests]
        for r, n in zip(requests, prefixes, strict=True):
            self.cached[r.slot] = n
        return logits, prefixes

    def _grow(
        self, requests: list[DraftRequest], logits: torch.Tensor, prefixes: list[int]
    ) -> list[Proposal]:
        """The trees from the roots' logits: one ``_feed`` per level below the first."""
        cands: list[list[_Candidate]] = [[] for _ in requests]
        fed: list[dict[int, int]] = [{} for _ in requests]  # candidate -> region offset
        probs: list[dict[int, torch.Tensor]] = [{} for _ in requests]
        beams: list[list[int]] = [[-1] for _ in requests]  # -1 stands for the root
        rows = [logits[b : b + 1] for b in range(len(requests))]
        for level in range(max(r.budget.depth for r in requests)):
            self._constrain(requests, beams, rows, cands)
            dists = self._proposal_distributions(requests, rows)
            top = self._top_children(requests, rows, level)
            for b, req in enumerate(requests):
                if level >= req.budget.depth:
                    beams[b] = []
                    continue
                new = self._expand(req, beams[b], top[b], dists[b], cands[b], probs[b])
                new.sort(key=lambda i: (not cands[b][i].spine, -cands[b][i].score))
                beams[b] = new[: req.budget.num_candidates]
            if level + 1 == max(r.budget.depth for r in requests) or not any(beams):
                break
            rows = self._feed(requests, prefixes, beams, cands, fed)

        proposals = []
        for b, req in enumerate(requests):
            keep = select_nodes(cands[b], req.budget.max_nodes)
            remap = {-1: 0} | {c: i + 1 for i, c in enumerate(keep)}
            tree = TokenTree(
                (req.token_ids[-1], *(cands[b][c].token for c in keep)),
                (-1, *(remap[cands[b][c].parent] for c in keep)),
            )
            node_probs = {remap[c]: p for c, p in probs[b].items() if c in remap}
            self._fed[req.slot] = (prefixes[b], {remap[c]: off for c, off in fed[b].items() if c in remap})
            proposals.append(Proposal(tree, node_probs))
        return proposals

    def _constrain(
        self,
        requests: list[DraftRequest],
        beams: list[list[int]],
        rows: list[torch.Tensor],
        cands: list[list[_Candidate]],
    ) -> None:
        """Prune a level to what each request's grammar allows after each beam node: disallowed
        tokens go to -inf in its row, and a node after which nothing is allowed leaves the beam."""
        for b, req in enumerate(requests):
            if req.grammar is None or not beams[b]:
                continue
            allowed = req.grammar.allowed([_path(cands[b], c) for c in beams[b]]).to(rows[b].device)
            if self.vocab is not None:
                allowed = allowed[:, self.vocab]
            keep = allowed.any(dim=-1).nonzero()[:, 0]
            beams[b] = [beams[b][i] for i in keep.tolist()]
            rows[b] = rows[b][keep].masked_fill(~allowed[keep], float("-inf"))

    @staticmethod
    def _proposal_distributions(
        requests: list[DraftRequest], rows: list[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """The distributions sampled requests draw children from, processed in one batch."""
        sampled = [b for b, r in enumerate(requests) if r.sample is not None and len(rows[b])]
        dists: list[torch.Tensor | None] = [None] * len(requests)
        if not sampled:
            return dists
        specs = [requests[b].sample.processing for b in sampled for _ in rows[b]]  # type: ignore[union-attr]
        merged = processed_probs(torch.cat([rows[b] for b in sampled]), specs)
        for b, chunk in zip(sampled, merged.split([len(rows[b]) for b in sampled]), strict=True):
            dists[b] = chunk
        return dists

    def _top_children(
        self, requests: list[DraftRequest], rows: list[torch.Tensor], level: int
    ) -> list[list[tuple[list[int], list[float]]]]:
        """Each greedy request's children per beam row: its top-k tokens by log-probability, for
        every greedy request of the batch in one top-k and one copy to the host."""
        greedy = [
            b for b, r in enumerate(requests) if r.sample is None and level < r.budget.depth and len(rows[b])
        ]
        choices: list[list[tuple[list[int], list[float]]]] = [[] for _ in requests]
        if not greedy:
            return choices
        merged = torch.cat([rows[b] for b in greedy])
        k = min(max(requests[b].budget.num_candidates for b in greedy), merged.shape[-1])
        top = torch.topk(torch.log_softmax(merged, dim=-1), k)
        tokens, scores = self._tokens(top.indices).tolist(), top.values.tolist()
        start = 0
        for b in greedy:
            end, width = start + len(rows[b]), requests[b].budget.num_candidates
            choices[b] = [
                (t[:width], s[:width]) for t, s in zip(tokens[start:end], scores[start:end], strict=True)
            ]
            start = end
        return choices

    def _expand(
        self,
        req: DraftRequest,
        beam: list[int],
        top: list[tuple[list[int], list[float]]],
        dists: torch.Tensor | None,
        cands: list[_Candidate],
        probs: dict[int, torch.Tensor],
    ) -> list[int]:
        """Add the children of each beam node and return their indices.

        Greedy requests take ``top`` (``_top_children``); sampled ones draw from ``dists``, the
        beam rows' processed distributions.
        """
        new = []
        k = req.budget.num_candidates
        if dists is None:
            choices = top
        else:
            assert req.sample is not None
            if req.sample.coupled:
                drawn = self._race_level(req, beam, cands, dists, k)
            else:
                generator = req.sample.generators.on(dists.device)
                drawn = [
                    torch.tensor(draw_without_replacement(q, k, generator), device=q.device) for q in dists
                ]
            choices = []
            for parent, q, picks in zip(beam, dists, drawn, strict=True):
                probs[parent] = self._over_vocabulary(q)
                choices.append((self._tokens(picks).tolist(), torch.log(q[picks]).tolist()))
        for parent, (picks, scores) in zip(beam, choices, strict=True):
            base = 0.0 if parent == -1 else cands[parent].score
            on_spine = parent == -1 or cands[parent].spine
            depth = 1 if parent == -1 else cands[parent].depth + 1
            for rank, (tok, lp) in enumerate(zip(picks, scores, strict=True)):
                if lp == float("-inf"):  # past the tokens a grammar allows (scores descend)
                    break
                cands.append(_Candidate(tok, parent, base + lp, rank, on_spine and rank == 0, depth))
                new.append(len(cands) - 1)
        return new

    def _race_level(
        self, req: DraftRequest, beam: list[int], cands: list[_Candidate], dists: torch.Tensor, k: int
    ) -> list[torch.Tensor]:
        """A seeded level's children, the columns of each row's race under the noise of the
        row's position: one race for the level (its rows share a position, hence its noise),
        over each row's ``RACED`` likeliest columns."""
        assert req.sample is not None
        positions = [len(req.token_ids) + (0 if p == -1 else cands[p].depth) for p in beam]
        return list(seeded_guesses(dists, req.sample.generators.seed, positions, self._tokens, k))

    def _tokens(self, columns: torch.Tensor) -> torch.Tensor:
        return columns if self.vocab is None else self.vocab[columns]

    def _over_vocabulary(self, q: torch.Tensor) -> torch.Tensor:
        """A distribution over the draft's columns as one over the whole vocabulary (zero on
        tokens the draft does not score), which acceptance compares with the target's."""
        if self.vocab is None:
            return q
        return q.new_zeros(self.runner.vocab_size).index_copy_(0, self.vocab, q)

    def _feed(
        self,
        requests: list[DraftRequest],
        prefixes: list[int],
        beams: list[list[int]],
        cands: list[list[_Candidate]],
        fed: list[dict[int, int]],
    ) -> list[torch.Tensor]:
        """One draft forward over every sequence's beam; returns each beam's logits rows."""
        tokens, depths, used, visible = self._place_level(beams, cands, fed)
        lens = torch.tensor(prefixes)[:, None]
        logits = self.runner.forward(
            [r.slot for r in requests], prefixes, tokens, lens + depths, lens[:, 0] + used, visible
        )
        return [logits[b, : len(beam)] for b, beam in enumerate(beams)]

    @staticmethod
    def _place_level(
        beams: list[list[int]], cands: list[list[_Candidate]], fed: list[dict[int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A level's tokens and depths below the root ``[B, W]``, each region's rows already
        used ``[B]`` and what every row sees ``[B, W, region]``.

        Row j of sequence b is written at region offset ``len(fed[b]) + j`` and sees the offsets
        its node's ``sees`` lists (ancestors and itself); padding rows see only themselves."""
        width = max(1, max(len(beam) for beam in beams))
        used = torch.tensor([len(f) for f in fed])
        region = int(used.max()) + width
        batch = len(beams)
        tokens = torch.zeros(batch, width, dtype=torch.long)
        depths = torch.zeros(batch, width, dtype=torch.long)
        offsets = used[:, None] + torch.arange(width)
        visible = torch.zeros(batch, width, region, dtype=torch.bool)
        visible.scatter_(2, offsets[..., None], True)
        seen: list[tuple[int, int, int]] = []  # (b, j, offset) of every ancestor a row sees
        for b, beam in enumerate(beams):
            for j, c in enumerate(beam):
                node = cands[b][c]
                fed[b][c] = int(offsets[b, j])
                parent_sees = cands[b][node.parent].sees if node.parent != -1 else ()
                node.sees = (*parent_sees, fed[b][c])
                tokens[b, j], depths[b, j] = node.token, node.depth - 1
                seen.extend((b, j, offset) for offset in parent_sees)
        if seen:
            visible[tuple(torch.tensor(seen).T)] = True
        return tokens, depths, used, visible

    def observe(
        self, slot: int, token_ids: list[int], width: int, since: int, sample: SampleSpec | None = None
    ) -> list[int | None]:
        """Catch the draft's cache up on ``token_ids`` and rank each known token from ``since``
        on among the draft's ``width`` guesses at its position: for a greedy or seeded
        sequence's output, whether a node with ``width`` children there would have held the
        target's token (a prompt's tokens say little about that). It costs one draft forward
        over the catch-up that drafting would make anyway, and nothing on the target."""
        start = self.cached.get(slot, 0)
        if start >= len(token_ids):
            return []
        logits = self.runner.forward_trees([slot], [start], [TokenTree.chain(token_ids[start:])])[0]
        self.cached[slot] = len(token_ids)
        first = max(start + 1, since)  # the first token ranked; row i guesses token start + 1 + i
        return self._ranks(
            logits[first - start - 1 : len(token_ids) - start - 1], token_ids, first, width, sample
        )

    def _ranks(
        self, rows: torch.Tensor, token_ids: list[int], first: int, width: int, sample: SampleSpec | None
    ) -> list[int | None]:
        """The rank of each ``token_ids[first + i]`` among row i's ``width`` guesses: its top
        ``width`` (greedy), or the winners of a seeded sample's race at that token's position,
        as drafting would choose them (None: not among them)."""
        if not len(rows):  # the catch-up fed only a token whose successor is not known yet
            return []
        if sample is None:
            columns = torch.topk(rows, min(width, rows.shape[-1])).indices
            hits = self._tokens(columns).cpu() == torch.tensor(token_ids[first:])[:, None]
        else:
            dists = processed_probs(rows, [sample.processing] * len(rows))
            positions = list(range(first, len(token_ids)))
            columns = seeded_guesses(dists, sample.generators.seed, positions, self._tokens, width)
            known = torch.tensor(token_ids[first:], device=rows.device)[:, None]
            hits = ((self._tokens(columns) == known) & (dists.gather(-1, columns) > 0)).cpu()
        return [row.index(True) if True in row else None for row in hits.tolist()]

    def commit(self, slot: int, proposal: Proposal, acceptance: Acceptance) -> None:
        """Keep the draft KV of accepted nodes that were fed to the draft (a prefix of the path)."""
        prefix, offsets = self._fed.pop(slot, (self.cached.get(slot, 0), {}))
        kept = []
        for node in acceptance.path[1:]:
            if node not in offsets:
                break
            kept.append(offsets[node])
        self.runner.cache.compact(slot, prefix, kept)
        self.cached[slot] = prefix + len(kept)
