"""Run the target as teacher: its replies to prompts, and its next-token distributions over text.

Both produce the same record: a token sequence, where its labelled part starts, and the target's
top-k log-probabilities at every labelled position (top-k truncation keeps shards small; the
draft only needs the head of the distribution to rank its candidates the same way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from multiguess.engine.runner import NativeRunner
from multiguess.engine.tree import TokenTree


@dataclass
class Record:
    """``ids[start:]`` are labelled; ``topk_*[i]`` is the teacher at position ``start - 1 + i``."""

    ids: torch.Tensor  # int32 [n]
    start: int
    topk_ids: torch.Tensor  # int32 [n - start, k]
    topk_logprobs: torch.Tensor  # float16 [n - start, k]


def chat_ids(tokenizer, user: str, assistant: str | None = None) -> list[int]:
    """Token ids of a one-turn chat; without ``assistant``, ends at the generation prompt."""
    messages = [{"role": "user", "content": user}]
    if assistant is not None:
        messages.append({"role": "assistant", "content": assistant})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=assistant is None, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


@torch.inference_mode()
def reply_records(
    runner: NativeRunner,
    tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int,
    k: int,
    max_prompt_tokens: int = 384,
) -> list[Record]:
    """The target's greedy replies to a batch of prompts, with its top-k at every reply position.

    Decoded by the engine's own runner, the forward it serves with (same kernels and dtype), so
    the draft learns the very replies it will be asked to predict; on CPUs this is about twice as
    fast as transformers' batched ``generate``. A reply ends after its end-of-turn token (the
    draft must predict the stop too). Finished rows stay in the batch until every row is done:
    the batch's slots then stay one contiguous run, which the cache reads without a copy.
    """
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = [chat_ids(tokenizer, p)[-max_prompt_tokens:] for p in prompts]
    if len(rows) > runner.cache.num_slots:
        raise ValueError(f"{len(rows)} prompts but the runner has {runner.cache.num_slots} slots")
    slots = list(range(len(rows)))
    runner.forward_trees(slots, [0] * len(rows), [TokenTree.chain(r[:-1]) for r in rows], last_only=True)
    replies: list[list[int]] = [[] for _ in rows]
    tops: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in rows]
    for step in range(max_new_tokens):
        last = [reply[-1] if reply else row[-1] for row, reply in zip(rows, replies, strict=True)]
        prefix_lens = [len(row) - 1 + step for row in rows]
        logits = runner.forward_trees(slots, prefix_lens, [TokenTree.chain([t]) for t in last])
        values, indices = (t.cpu() for t in torch.log_softmax(logits[:, 0], dim=-1).topk(k, dim=-1))
        for i, reply in enumerate(replies):
            if reply and reply[-1] == eos_id:
                continue
            reply.append(int(indices[i, 0]))
            tops[i].append((indices[i].to(torch.int32), values[i].to(torch.float16)))
        if all(reply[-1] == eos_id for reply in replies):
            break
    return [
        Record(
            torch.tensor(row + reply, dtype=torch.int32),
            len(row),
            torch.stack([t[0] for t in top]),
            torch.stack([t[1] for t in top]),
        )
        for row, reply, top in zip(rows, replies, tops, strict=True)
    ]


@torch.inference_mode()
def teacher_forced_records(
    model, tokenizer, pairs: Sequence[tuple[str, str]], k: int, max_tokens: int = 512
) -> list[Record]:
    """The target's top-k over given (user, assistant) chats, labelled on the assistant's text."""
    records = []
    contexts = [chat_ids(tokenizer, user) for user, _ in pairs]
    sequences = [chat_ids(tokenizer, user, reply)[:max_tokens] for user, reply in pairs]
    width = max(len(s) for s in sequences)
    pad_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
    mask = (torch.arange(width)[None, :] < torch.tensor([len(s) for s in sequences])[:, None]).long()
    logits = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).logits
    values, indices = (t.cpu() for t in torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1))
    for i, (context, sequence) in enumerate(zip(contexts, sequences, strict=True)):
        start = len(context)
        if start >= len(sequence):
            continue
        positions = slice(start - 1, len(sequence) - 1)
        records.append(
            Record(
                torch.tensor(sequence, dtype=torch.int32),
                start,
                indices[i, positions].to(torch.int32),
                values[i, positions].to(torch.float16),
            )
        )
    return records
