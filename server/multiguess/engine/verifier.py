"""Step 5 of the loop: which drafted path each sequence keeps of its verified tree, and the count.

Every rule reads the target's logits after each node as the request adjusts them (penalties,
bias, grammar: ``penalties.node_logits``). A greedy sequence keeps the path of the target's
argmax. A seeded sample's output is fixed by its seed alone, so it is verified like greedy
output against the choices the seed makes (``acceptance.SeededChoices``). Any other sample is
verified by multi-draft speculative sampling against the distributions its children were drawn
from (``acceptance.accept_sampled``), which keeps its output distribution exactly the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from multiguess.engine.acceptance import Acceptance, SeededChoices, accept_greedy, accept_sampled
from multiguess.engine.batch_acceptance import accept_batch
from multiguess.engine.drafter import Proposal
from multiguess.engine.penalties import node_logits
from multiguess.engine.sampling import NodeDistributions
from multiguess.engine.sequence import Sequence, SpecStats


@dataclass(frozen=True)
class Verdict:
    """What the target made of one sequence's tree."""

    acceptance: Acceptance
    rows: torch.Tensor  # the target's adjusted logits after each node
    probs: NodeDistributions | None  # their processed distributions (sampled sequences only)


def accept_trees(
    batch: list[Sequence],
    proposals: list[Proposal],
    logits: torch.Tensor,
    eos_ids: frozenset[int],
    batched: bool,
) -> list[Verdict]:
    """Each sequence's verdict on its tree from the verification forward's ``logits``: for the
    whole batch in tensor ops on the device, read back once (``batched``:
    ``batch_acceptance.py``), or node by node on the host (the CPU family's kernels)."""
    rows = [
        node_logits(seq, p.tree, logits[b], eos_ids)
        for b, (seq, p) in enumerate(zip(batch, proposals, strict=True))
    ]
    target_probs = target_distributions(batch, rows)
    if batched:
        acceptances = accept_batch(batch, proposals, logits, rows)
    else:
        acceptances = [
            accept_tree(seq, proposal, rows[b], target_probs.get(b), logits.device)
            for b, (seq, proposal) in enumerate(zip(batch, proposals, strict=True))
        ]
    return [Verdict(acceptance, rows[b], target_probs.get(b)) for b, acceptance in enumerate(acceptances)]


def accept_tree(
    seq: Sequence,
    proposal: Proposal,
    rows: torch.Tensor,
    target_probs: NodeDistributions | None,
    device: torch.device,
) -> Acceptance:
    """The path ``seq`` keeps of ``proposal``'s tree by its rule: greedy, seeded or sampled."""
    if seq.params.greedy:
        return accept_greedy(proposal.tree, NodeArgmax(rows))
    assert target_probs is not None and seq.generators is not None
    if seq.params.seed is not None:  # the seed alone fixes its output: verified like greedy
        choices = SeededChoices(target_probs, proposal.tree, seq.params.seed, len(seq.token_ids))
        return accept_greedy(proposal.tree, choices)
    return accept_sampled(proposal.tree, target_probs, proposal.draft_probs, seq.generators.on(device))


class NodeArgmax:
    """The target's token after each node, taken when acceptance reads it: greedy acceptance
    reads only the rows of the path it accepts (the last one's gives the bonus token). On the
    host through numpy, whose argmax over a vocabulary-wide row is an order of magnitude faster
    than torch's on CPUs; both take the first of equal maxima (and of NaNs)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows.numpy() if rows.device.type == "cpu" and rows.dtype != torch.bfloat16 else rows

    def __getitem__(self, node: int) -> int:
        return int(self.rows[node].argmax())


def target_distributions(batch: list[Sequence], rows: list[torch.Tensor]) -> dict[int, NodeDistributions]:
    """The processed target distribution at every tree node of the sampled sequences, from
    each sequence's (adjusted) logits after each of its nodes, processed as acceptance reads them."""
    return {
        b: NodeDistributions(rows[b], seq.processing) for b, seq in enumerate(batch) if not seq.params.greedy
    }


def record(stats: SpecStats, proposal: Proposal, acceptance: Acceptance) -> None:
    """Count one verified step of a tree in ``stats``: its drafted and accepted tokens, those
    that grafted copy or prediction drafts contributed apart."""
    grafted = len(proposal.tree) - proposal.own_nodes
    copied = sum(node >= proposal.own_nodes for node in acceptance.path)
    stats.verify_steps += 1
    stats.draft_tokens += len(proposal.tree) - 1
    stats.accepted_tokens += acceptance.accepted_drafts
    stats.count("model", proposal.own_nodes - 1, acceptance.accepted_drafts - copied)
    stats.count("prediction" if proposal.predicted else "copy", grafted, copied)
