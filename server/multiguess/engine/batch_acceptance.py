"""A step's acceptance for the whole batch on the device: one copy in, one read back.

On a GPU every value the host reads waits for the device's queue to drain, and acceptance
node by node (``engine/acceptance.py``'s walks) reads values at every node. Here the batch's
trees, settings and seeded noise keys go to the device in one copy; greedy, seeded and unseeded
sequences are accepted by the batched rules (``acceptance.accepted_paths``,
``acceptance.accept_sampled_rows``, ``sampling.raced_rows``); and the host reads every
sequence's accepted path and tokens in one transfer. The rules are the walks' own, so greedy
and seeded outputs are the same tokens and unseeded ones the same distribution.
"""

from __future__ import annotations

import torch

from multiguess.engine.acceptance import Acceptance, accept_sampled_rows, accepted_paths
from multiguess.engine.drafter import Proposal
from multiguess.engine.one_copy import Packed
from multiguess.engine.sampling import (
    RowSettings,
    position_key,
    raced_rows,
    settings_table,
)
from multiguess.engine.sequence import Sequence
from multiguess.engine.tree import TokenTree

# Rows raced at once for seeded sequences: the noise is a [rows, V] tensor.
RACED_ROWS = 64


def padded_rows(logits: torch.Tensor, rows: list[torch.Tensor]) -> torch.Tensor:
    """The batch's node logits ``[B, N, V]``: ``logits`` itself where every sequence's rows are
    its own, else a copy with the adjusted ones (penalties, grammars) written in."""
    if all(r.data_ptr() == logits[b].data_ptr() for b, r in enumerate(rows)):
        return logits
    out = logits.float().clone()
    for b, r in enumerate(rows):
        if r.data_ptr() != logits[b].data_ptr():
            out[b, : len(r)] = r
    return out


def accept_batch(
    batch: list[Sequence], proposals: list[Proposal], logits: torch.Tensor, rows: list[torch.Tensor]
) -> list[Acceptance]:
    """Every sequence's acceptance of its proposal, from the verification ``logits``
    ``[B, N, V]`` and each sequence's adjusted rows (``penalties.node_logits``)."""
    device, vocab = logits.device, logits.shape[-1]
    nodes = padded_rows(logits, rows)
    trees = [p.tree for p in proposals]
    width = nodes.shape[1]
    depth = max(t.max_depth for t in trees)
    seeded = [b for b, s in enumerate(batch) if not s.params.greedy and s.params.seed is not None]
    sampled = [b for b, s in enumerate(batch) if not s.params.greedy and s.params.seed is None]
    pack = Packed()
    tokens_at = pack.add(torch.tensor([(*t.tokens, *(-1,) * (width - len(t))) for t in trees]))
    parents_at = pack.add(torch.tensor([(*t.parents, *(0,) * (width - len(t))) for t in trees]))
    processing = [s.processing for s in batch]
    settings_at = pack.add(settings_table(processing, vocab))
    truncating = any(processing[b].truncates(vocab) for b in seeded + sampled)
    if seeded:
        seeded_at = pack.add(torch.tensor(seeded))
        keys_at = pack.add(torch.tensor([seed_keys(batch[b], trees[b], width) for b in seeded]))
    if sampled:
        sampled_at = pack.add(torch.tensor(sampled))
        tries = max(1, max(len(c) for b in sampled for c in trees[b].children()))
        children_at = pack.add(torch.tensor([child_table(trees[b], width, tries) for b in sampled]))
        draft_rows, draft_index = draft_table([proposals[b] for b in sampled], width)
        index_at = pack.add(draft_index)
    sent = pack.send(device)
    tokens, parents = sent[tokens_at], sent[parents_at]
    settings = RowSettings.of(sent[settings_at], truncating)
    choice = nodes.argmax(dim=-1)
    if seeded:
        which = sent[seeded_at]
        choice = choice.index_copy(0, which, seeded_choices(nodes[which], settings[which], sent[keys_at]))
    path, lengths = accepted_paths(tokens, parents, choice, depth)
    path = torch.nn.functional.pad(path, (0, 1))
    emitted = choice.gather(1, path)
    if sampled:
        which = sent[sampled_at]
        uniforms = torch.stack(
            [
                torch.rand(
                    depth + 1,
                    tries + 1,
                    generator=batch[b].generators.on(device),
                    dtype=torch.float64,
                    device=device,
                )
                for b in sampled
            ]
        )
        drawn, drawn_lengths, bonus = accept_sampled_rows(
            nodes[which],
            tokens[which],
            sent[children_at],
            draft_rows,
            sent[index_at],
            settings[which],
            uniforms,
        )
        following = torch.nn.functional.pad(tokens[which].gather(1, drawn[:, 1:]), (0, 1))
        last = torch.arange(drawn.shape[1], device=device)[None, :] == (drawn_lengths - 1)[:, None]
        path = path.index_copy(0, which, drawn)
        lengths = lengths.index_copy(0, which, drawn_lengths)
        emitted = emitted.index_copy(0, which, torch.where(last, bonus[:, None], following))
    outcome = torch.cat([lengths[:, None], path, emitted], dim=1).tolist()
    span = path.shape[1]
    acceptances = []
    for row in outcome:
        n = row[0]
        acceptances.append(Acceptance(row[1 : 1 + n], row[1 + span : 1 + span + n]))
    return acceptances


def seed_keys(seq: Sequence, tree: TokenTree, width: int) -> list[int]:
    """The noise key of every node of a seeded sequence's tree (0 for padding): node i chooses
    token ``len(seq.token_ids) + depth(i)`` (``acceptance.SeededChoices``)."""
    assert seq.params.seed is not None
    length = len(seq.token_ids)
    keys = [position_key(seq.params.seed, length + d) for d in tree.depths]
    return keys + [0] * (width - len(keys))


def seeded_choices(logits: torch.Tensor, settings: RowSettings, keys: torch.Tensor) -> torch.Tensor:
    """The token a seeded sample takes after every node ``[S, N]`` of its tree, raced
    ``RACED_ROWS`` rows at a time (the noise is a row over the vocabulary)."""
    count, width, vocab = logits.shape
    flat = logits.reshape(count * width, vocab)
    repeated = settings[torch.arange(count, device=logits.device).repeat_interleave(width)]
    flat_keys = keys.reshape(-1)
    chunks = [
        raced_rows(
            flat[i : i + RACED_ROWS], repeated[slice(i, i + RACED_ROWS)], flat_keys[i : i + RACED_ROWS]
        )
        for i in range(0, count * width, RACED_ROWS)
    ]
    return torch.cat(chunks).reshape(count, width)


def child_table(tree: TokenTree, width: int, tries: int) -> list[list[int]]:
    """Each node's children in order, padded with -1 to ``tries`` and the tree to ``width``."""
    kids = tree.children()
    table = [(*c, *(-1,) * (tries - len(c))) for c in kids]
    return table + [(-1,) * tries] * (width - len(table))


def draft_table(proposals: list[Proposal], width: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The draft distributions of sampled children, stacked on their device ``[M, V]`` (None:
    every child is deterministic), and each node's row in it ``[B, N]`` (-1: none)."""
    index = torch.full((len(proposals), width), -1, dtype=torch.long)
    rows = []
    for b, proposal in enumerate(proposals):
        for node, q in sorted(proposal.draft_probs.items()):
            index[b, node] = len(rows)
            rows.append(q)
    return (torch.stack(rows) if rows else None), index
