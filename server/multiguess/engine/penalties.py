"""Penalties, bias and ``min_tokens`` on the target's logits at every node of a token tree.

A node's logits predict the token after it, so the text they condition on is the sequence
plus the path from the root to that node: its penalty counts include its ancestors' tokens
and its own. The adjusted rows are what plain decoding with the same settings would see at
that point, which keeps greedy speculation token-identical and sampled speculation exact.

Order, as vLLM applies them: ``logit_bias``; ``min_tokens`` (end-of-sequence and stop tokens
to -inf while too few tokens were generated); ``repetition_penalty`` on every token seen in
the prompt or the output (positive logits divided, negative ones multiplied);
``frequency_penalty`` times each token's count in the output and ``presence_penalty`` once
for every token the output holds, both subtracted.
"""

from __future__ import annotations

import torch

from multiguess.engine.grammar import constrain
from multiguess.engine.sequence import Sequence
from multiguess.engine.tree import TokenTree
from multiguess.params import SamplingParams


def adjusted_logits(
    rows: torch.Tensor,
    tree: TokenTree,
    params: SamplingParams,
    prompt_ids: list[int],
    output_ids: list[int],
    stop_ids: frozenset[int],
) -> torch.Tensor:
    """``rows[i]`` (the logits after tree node ``i``) with the request's adjustments; the same
    tensor when it asks for none."""
    if not params.adjusts_logits:
        return rows
    count, vocab = len(tree), rows.shape[-1]
    device = rows.device
    out = rows[:count].float().clone()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=device)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=out.dtype, device=device)
        out[:, ids] += bias
    if params.min_tokens and stop_ids:
        early = torch.tensor(
            [len(output_ids) + d < params.min_tokens for d in tree.depths], dtype=torch.bool, device=device
        )
        barred = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        out[early[:, None] & torch.isin(torch.arange(vocab, device=device), barred)[None, :]] = float("-inf")
    generated = _generated_counts(tree, output_ids, vocab, device)
    if params.repetition_penalty != 1.0:
        seen = generated > 0
        if prompt_ids:
            seen[:, torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
        penalty = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / penalty, out * penalty), out)
    if params.frequency_penalty:
        out -= params.frequency_penalty * generated
    if params.presence_penalty:
        out -= params.presence_penalty * (generated > 0).to(out.dtype)
    return out


def _generated_counts(
    tree: TokenTree, output_ids: list[int], vocab: int, device: torch.device
) -> torch.Tensor:
    """``[nodes, V]`` counts of each token in the output followed by the path to each node
    (the root is the sequence's last token, already counted when it was generated)."""
    base = torch.bincount(torch.tensor(output_ids, dtype=torch.long, device=device), minlength=vocab)
    counts = base[None, :].repeat(len(tree), 1).float()
    node_rows, tokens = [], []
    for node in range(1, len(tree)):
        ancestor = node
        while ancestor > 0:
            node_rows.append(node)
            tokens.append(tree.tokens[ancestor])
            ancestor = tree.parents[ancestor]
    if node_rows:
        index = (
            torch.tensor(node_rows, dtype=torch.long, device=device),
            torch.tensor(tokens, dtype=torch.long, device=device),
        )
        counts.index_put_(index, torch.ones(len(tokens), device=device), accumulate=True)
    return counts


def node_logits(
    seq: Sequence, tree: TokenTree, logits: torch.Tensor, eos_ids: frozenset[int]
) -> torch.Tensor:
    """The target's logits after each node of ``seq``'s tree (``logits`` holds the sequence's
    rows, padding included), adjusted by its request and masked by its grammar at each node."""
    rows = adjusted_logits(
        logits[: len(tree)], tree, seq.params, seq.prompt_ids, seq.output_ids, seq.stop_ids(eos_ids)
    )
    if seq.grammar is None:
        return rows
    return constrain(rows, seq.grammar.allowed(tree.paths()).to(rows.device))
