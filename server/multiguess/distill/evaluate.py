"""How good and how cheap a draft is, measured the way speculation uses it.

Quality is teacher-forced on the target's own greedy replies to held-out prompts: at every reply
position, is the target's argmax the draft's argmax (greedy acceptance) or within the draft's
top-k (what a tree of k children per node can catch)? Cost is the wall time of one-token decode
forwards with a KV cache, draft over target, in the same dtype and thread count.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from multiguess.distill.teacher import Record
from multiguess.distill.train import collate, draft_logits

MAX_K = 4


def chain_tokens_per_step(matches: Sequence[bool], depth: int) -> float:
    """Tokens emitted per verify step by chain speculation of ``depth`` drafts over a match sequence."""
    position, steps, emitted = 0, 0, 0
    while position < len(matches):
        accepted = 0
        while accepted < depth and position + accepted < len(matches) and matches[position + accepted]:
            accepted += 1
        emitted += min(accepted + 1, len(matches) - position)
        position += accepted + 1
        steps += 1
    return emitted / max(1, steps)


@torch.inference_mode()
def quality(
    model,
    records: Sequence[Record],
    pad_id: int,
    autocast: bool = False,
    tokens_per_batch: int = 4096,
    vocab: torch.Tensor | None = None,
) -> dict[str, float]:
    """Greedy acceptance, top-k coverage (k=1..4) and chain tokens/step (depth 4) on reply records.

    The label is the token the target actually emitted (its greedy choice), not the stored top-1,
    which can differ from it on bf16 ties. With ``vocab`` the draft ranks only those tokens, as
    it does when serving with its draft vocabulary.
    """
    outside = None
    if vocab is not None:
        outside = torch.full((model.config.vocab_size,), float("-inf"))
        outside[vocab] = 0.0
    hits = torch.zeros(MAX_K)
    total = 0
    per_record: list[list[bool]] = []
    start = 0
    while start < len(records):
        end, labelled = start, 0
        while end < len(records) and labelled < tokens_per_batch:
            labelled += len(records[end].topk_ids)
            end += 1
        batch = collate(records[start:end], pad_id)
        logits = draft_logits(model, batch, autocast).float()
        if outside is not None:
            logits += outside
        draft_top = logits.topk(MAX_K, dim=-1).indices
        target_top1 = batch.ids[batch.rows, batch.cols + 1][:, None]
        found = (draft_top == target_top1).cumsum(dim=1).clamp(max=1)
        hits += found.sum(dim=0).float()
        total += len(target_top1)
        matches = (draft_top[:, 0] == target_top1[:, 0]).tolist()
        offset = 0
        for record in records[start:end]:
            n = len(record.topk_ids)
            per_record.append(matches[offset : offset + n])
            offset += n
        start = end
    coverage = (hits / max(1, total)).tolist()
    return {
        "acceptance": coverage[0],
        **{f"top{k + 1}_coverage": coverage[k] for k in range(MAX_K)},
        "chain4_tokens_per_step": statistics.fmean(chain_tokens_per_step(m, 4) for m in per_record),
        "positions": total,
        "sequences": len(records),
    }


@torch.inference_mode()
def decode_seconds_per_token(model, prompt_tokens: int = 64, steps: int = 32, repeats: int = 3) -> float:
    """Median wall time of a one-token forward with a KV cache after a prompt of random tokens."""
    generator = torch.Generator().manual_seed(0)
    times: list[float] = []
    for _ in range(repeats):
        ids = torch.randint(0, model.config.vocab_size, (1, prompt_tokens), generator=generator)
        out = model(input_ids=ids, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            begin = time.perf_counter()
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - begin)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return statistics.median(times)


def cost_ratio(draft, target, rounds: int = 3) -> dict[str, float]:
    """Draft over target per-token decode time, alternating the two to share any machine noise."""
    draft_times, target_times = [], []
    for _ in range(rounds):
        draft_times.append(decode_seconds_per_token(draft))
        target_times.append(decode_seconds_per_token(target))
    d, t = statistics.median(draft_times), statistics.median(target_times)
    return {
        "draft_ms_per_token": d * 1000,
        "target_ms_per_token": t * 1000,
        "cost_ratio": d / t,
        "threads": torch.get_num_threads(),
    }
