"""Growing a drafted tree level by level: the part the model and EAGLE-3 drafters share.

A ``TreeGrower`` holds the tree rules: per level, every beam node gets its ``num_candidates``
best (or sampled, or seeded-raced) children, pruned to what a grammar allows; the spine child
and the children with the highest cumulative log-probability, ``num_candidates`` in all, form
the next beam; at the end the best ``max_nodes`` nodes form the tree (``select_nodes``). What
it drafts with is the drafter's: the roots' logits, and a ``FeedLevel`` that runs one forward
over a level's beams and returns their logits rows. ``place_level`` lays a level out in the
region after each sequence's committed positions, for the drafter's forward.

An unseeded sample's children are scored by the draft's k-th largest probability at their
parent (k their draw rank), not by their own: which drawn children the beam and the budget keep
must not depend on the tokens drawn, or a kept child is no longer a draw from the distribution
acceptance compares it with, and the output leaves the target's distribution. Greedy and seeded
trees are verified against fixed choices, so their nodes keep their own log-probabilities.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import torch

from multiguess.engine.drafter import DraftRequest, Proposal, SampleSpec
from multiguess.engine.sampling import draw_without_replacement, processed_probs, race_top
from multiguess.engine.tree import TokenTree

# A seeded sample's children race over each row's likeliest columns only: a token beyond them
# rarely wins, and a tree need only be a good guess, since the seed alone fixes the output.
RACED = 64


@dataclass
class Candidate:
    """A drafted node before the final selection (``index`` is its order of creation)."""

    token: int
    parent: int  # candidate index, -1 for children of the root
    score: float  # cumulative draft log-probability
    sibling_rank: int  # order among its siblings (draw order when sampled)
    spine: bool = False  # on the chain of first children: what chain speculation would draft
    depth: int = 1  # levels below the root
    sees: tuple[int, ...] = ()  # once fed to the draft: region offsets of its ancestors and itself


@dataclass
class Level:
    """One level to feed the draft: each sequence's beam (candidate indices into its
    candidates), after its region's start (``prefixes``), and the region offsets every fed
    candidate took (``fed``, which ``place`` extends)."""

    requests: list[DraftRequest]
    prefixes: list[int]
    beams: list[list[int]]
    cands: list[list[Candidate]]
    fed: list[dict[int, int]]

    def place(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``place_level`` of this level."""
        return place_level(self.beams, self.cands, self.fed)


# One draft forward over a level's beams: each beam's logits rows.
FeedLevel = Callable[[Level], list[torch.Tensor]]


@dataclass
class Grown:
    """A drafted proposal, and the region offset each of its nodes was fed at (node -> offset)."""

    proposal: Proposal
    fed: dict[int, int]


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


def path_tokens(cands: list[Candidate], index: int) -> tuple[int, ...]:
    """The drafted tokens from the root down to candidate ``index`` (-1, the root: none)."""
    tokens = []
    while index != -1:
        tokens.append(cands[index].token)
        index = cands[index].parent
    return tuple(reversed(tokens))


def select_nodes(candidates: list[Candidate], max_nodes: int) -> list[int]:
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


def place_level(
    beams: list[list[int]], cands: list[list[Candidate]], fed: list[dict[int, int]]
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


class TreeGrower:
    """The tree rules over a drafter's logit columns: ``vocab`` gives the token of each column
    when the drafter scores only its own vocabulary (None: column = token), ``vocab_size`` the
    target's. ``wire_exact`` rounds the distributions children are sampled from to float32
    first, so that the float32 rows a draft server sends are exactly what was sampled."""

    def __init__(self, vocab: torch.Tensor | None, vocab_size: int, wire_exact: bool = False) -> None:
        self.vocab = vocab
        self.vocab_size = vocab_size
        self.wire_exact = wire_exact

    def grow(
        self, requests: list[DraftRequest], logits: torch.Tensor, prefixes: list[int], feed: FeedLevel
    ) -> list[Grown]:
        """The trees from the roots' logits ``[B, V']`` (each sequence's region starting at its
        ``prefixes`` entry): one ``feed`` per level below the first."""
        cands: list[list[Candidate]] = [[] for _ in requests]
        fed: list[dict[int, int]] = [{} for _ in requests]  # candidate -> region offset
        probs: list[dict[int, torch.Tensor]] = [{} for _ in requests]
        beams: list[list[int]] = [[-1] for _ in requests]  # -1 stands for the root
        rows = [logits[b : b + 1] for b in range(len(requests))]
        depth = max(r.budget.depth for r in requests)
        for level in range(depth):
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
            if level + 1 == depth or not any(beams):
                break
            rows = feed(Level(requests, prefixes, beams, cands, fed))

        grown = []
        for b, req in enumerate(requests):
            keep = select_nodes(cands[b], req.budget.max_nodes)
            remap = {-1: 0} | {c: i + 1 for i, c in enumerate(keep)}
            tree = TokenTree(
                (req.token_ids[-1], *(cands[b][c].token for c in keep)),
                (-1, *(remap[cands[b][c].parent] for c in keep)),
            )
            node_probs = {remap[c]: p for c, p in probs[b].items() if c in remap}
            offsets = {remap[c]: off for c, off in fed[b].items() if c in remap}
            grown.append(Grown(Proposal(tree, node_probs), offsets))
        return grown

    def ranks(
        self, rows: torch.Tensor, token_ids: list[int], first: int, width: int, sample: SampleSpec | None
    ) -> list[int | None]:
        """The rank of each ``token_ids[first + i]`` among row i's ``width`` guesses: its top
        ``width`` (greedy), or the winners of a seeded sample's race at that token's position,
        as drafting would choose them (None: not among them)."""
        if not len(rows):  # the catch-up fed only a token whose successor is not known yet
            return []
        if sample is None:
            columns = torch.topk(rows, min(width, rows.shape[-1])).indices
            hits = self.tokens(columns).cpu() == torch.tensor(token_ids[first:])[:, None]
        else:
            dists = processed_probs(rows, [sample.processing] * len(rows))
            positions = list(range(first, len(token_ids)))
            columns = seeded_guesses(dists, sample.generators.seed, positions, self.tokens, width)
            known = torch.tensor(token_ids[first:], device=rows.device)[:, None]
            hits = ((self.tokens(columns) == known) & (dists.gather(-1, columns) > 0)).cpu()
        return [row.index(True) if True in row else None for row in hits.tolist()]

    def tokens(self, columns: torch.Tensor) -> torch.Tensor:
        """The token ids of logit columns."""
        return columns if self.vocab is None else self.vocab[columns]

    def _constrain(
        self,
        requests: list[DraftRequest],
        beams: list[list[int]],
        rows: list[torch.Tensor],
        cands: list[list[Candidate]],
    ) -> None:
        """Prune a level to what each request's grammar allows after each beam node: disallowed
        tokens go to -inf in its row, and a node after which nothing is allowed leaves the beam."""
        for b, req in enumerate(requests):
            if req.grammar is None or not beams[b]:
                continue
            allowed = req.grammar.allowed([path_tokens(cands[b], c) for c in beams[b]]).to(rows[b].device)
            if self.vocab is not None:
                allowed = allowed[:, self.vocab]
            keep = allowed.any(dim=-1).nonzero()[:, 0]
            beams[b] = [beams[b][i] for i in keep.tolist()]
            rows[b] = rows[b][keep].masked_fill(~allowed[keep], float("-inf"))

    def _proposal_distributions(
        self, requests: list[DraftRequest], rows: list[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """The distributions sampled requests draw children from, processed in one batch."""
        sampled = [(b, r.sample) for b, r in enumerate(requests) if r.sample is not None and len(rows[b])]
        dists: list[torch.Tensor | None] = [None] * len(requests)
        if not sampled:
            return dists
        specs = [sample.processing for b, sample in sampled for _ in rows[b]]
        merged = processed_probs(torch.cat([rows[b] for b, _ in sampled]), specs)
        if self.wire_exact:
            merged = merged.float().double()
        for (b, _), chunk in zip(sampled, merged.split([len(rows[b]) for b, _ in sampled]), strict=True):
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
        tokens, scores = self.tokens(top.indices).tolist(), top.values.tolist()
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
        cands: list[Candidate],
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
                # An unseeded draw is scored by its rank's probability, not its own (module doc).
                weights = q[picks] if req.sample.coupled else torch.topk(q, len(picks)).values
                choices.append((self.tokens(picks).tolist(), torch.log(weights).tolist()))
        for parent, (picks, scores) in zip(beam, choices, strict=True):
            base = 0.0 if parent == -1 else cands[parent].score
            on_spine = parent == -1 or cands[parent].spine
            depth = 1 if parent == -1 else cands[parent].depth + 1
            for rank, (tok, lp) in enumerate(zip(picks, scores, strict=True)):
                if lp == float("-inf"):  # past the tokens a grammar allows (scores descend)
                    break
                cands.append(Candidate(tok, parent, base + lp, rank, on_spine and rank == 0, depth))
                new.append(len(cands) - 1)
        return new

    def _race_level(
        self, req: DraftRequest, beam: list[int], cands: list[Candidate], dists: torch.Tensor, k: int
    ) -> list[torch.Tensor]:
        """A seeded level's children, the columns of each row's race under the noise of the
        row's position: one race for the level (its rows share a position, hence its noise),
        over each row's ``RACED`` likeliest columns."""
        assert req.sample is not None
        positions = [len(req.token_ids) + (0 if p == -1 else cands[p].depth) for p in beam]
        return list(seeded_guesses(dists, req.sample.generators.seed, positions, self.tokens, k))

    def _over_vocabulary(self, q: torch.Tensor) -> torch.Tensor:
        """A distribution over the draft's columns as one over the whole vocabulary (zero on
        tokens the draft does not score), which acceptance compares with the target's."""
        if self.vocab is None:
            return q
        return q.new_zeros(self.vocab_size).index_copy_(0, self.vocab, q)
