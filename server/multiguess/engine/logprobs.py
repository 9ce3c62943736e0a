"""Log-probabilities of emitted tokens, from the target's own processed distribution.

Token ``j`` of a step was chosen at node ``path[j]`` of the tree (the accepted drafted tokens,
then the bonus), so its log-probability is read from that node's row: the very distribution
plain decoding samples from at that point. Sampled requests use their processed distribution
(temperature, top-k, top-p after penalties); greedy ones the log-softmax of their adjusted
logits, since a point mass would say nothing. Tokens outside a truncated distribution report
``FLOOR`` (JSON has no -inf), as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from multiguess.engine.sampling import NodeDistributions

FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most probable tokens, best first


def emitted_logprobs(rows: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """``rows[j]``: the log-probabilities ``tokens[j]`` was chosen from (the row of ``path[j]``)."""
    chosen = rows.gather(1, torch.tensor(tokens, dtype=torch.long, device=rows.device)[:, None])[:, 0]
    chosen_list = chosen.clamp(min=FLOOR).tolist()
    if top:
        best = torch.topk(rows, min(top, rows.shape[-1]), dim=-1)
        pairs = [
            tuple(zip(ids, values, strict=True))
            for ids, values in zip(best.indices.tolist(), best.values.clamp(min=FLOOR).tolist(), strict=True)
        ]
    else:
        pairs = [()] * len(tokens)
    return [TokenLogprob(t, lp, p) for t, lp, p in zip(tokens, chosen_list, pairs, strict=True)]


def step_logprobs(
    top: int | None,
    path: list[int],
    tokens: list[int],
    logits: torch.Tensor,
    probs: NodeDistributions | None,
) -> list[TokenLogprob] | None:
    """The records of one step's emitted ``tokens`` (None unless the request asks for them):
    from the processed ``probs`` of a sampled sequence, or its adjusted ``logits`` when greedy."""
    if top is None:
        return None
    if probs is not None:
        rows = torch.log(probs.stacked(path).double())
    else:
        index = torch.tensor(path, dtype=torch.long, device=logits.device)
        rows = torch.log_softmax(logits[index].double(), dim=-1)
    return emitted_logprobs(rows, tokens, top)


# Prompt positions whose log-probabilities one forward computes at most (a [rows, V] tensor),
# chunked prefill or not: prompt log-probabilities take bounded memory.
PROMPT_LOGPROB_ROWS = 256
ROWS_AT_ONCE = 64  # prompt positions normalised together: a [64, V] float64 tensor at most


def prompt_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """The records of prompt ``tokens`` from the raw logits of the positions before each (row
    ``j`` predicts ``tokens[j]``): the model's own distribution, as vLLM reports prompt
    log-probabilities; penalties and temperature shape what is generated, not what was given.
    Rows are normalised ``ROWS_AT_ONCE`` at a time, so the float64 copy stays small however
    long the chunk."""
    records: list[TokenLogprob] = []
    for start in range(0, len(tokens), ROWS_AT_ONCE):
        rows = torch.log_softmax(logits[start : start + ROWS_AT_ONCE].double(), dim=-1)
        records += emitted_logprobs(rows, tokens[start : start + ROWS_AT_ONCE], top)
    return records
