"""Run the target as teacher: its replies to prompts, and its next-token distributions over text.

Both produce the same record: a token sequence, where its labelled part starts, and the target's
top-k log-probabilities at every labelled position (top-k truncation keeps shards small; the
draft only needs the head of the distribution to rank its candidates the same way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Record:
    """``ids[start:]`` are labelled; ``topk_*[i]`` is the teacher at position ``start - 1 + i``."""

    ids: torch.Tensor  # int32 [n]
    start: int
    topk_ids: torch.Tensor  # int32 [n - start, k]
    topk_logprobs: torch.Tensor  # float16 [n - start, k]


class TopKRecorder:
    """A logits processor that records the teacher's top-k at each generation step, unchanged."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        values, indices = torch.log_softmax(scores.float(), dim=-1).topk(self.k, dim=-1)
        self.steps.append((indices.to(torch.int32), values.to(torch.float16)))
        return scores


def chat_ids(tokenizer, user: str, assistant: str | None = None) -> list[int]:
    """Token ids of a one-turn chat; without ``assistant``, ends at the generation prompt."""
    messages = [{"role": "user", "content": user}]
    if assistant is not None:
        messages.append({"role": "assistant", "content": assistant})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=assistant is None, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def left_pad(rows: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) with rows right-aligned, as batched generation needs."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids, mask


def reply_length(generated: torch.Tensor, eos_id: int) -> int:
    """Tokens up to and including the first end-of-turn (the draft must predict the stop too)."""
    hits = (generated == eos_id).nonzero()
    return int(hits[0]) + 1 if len(hits) else len(generated)


@torch.inference_mode()
def generate_records(
    model, tokenizer, prompts: Sequence[str], max_new_tokens: int, k: int, max_prompt_tokens: int = 384
) -> list[Record]:
    """The target's greedy replies to a batch of prompts, with its top-k at every reply position."""
    from transformers import LogitsProcessorList

    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = [chat_ids(tokenizer, p)[-max_prompt_tokens:] for p in prompts]
    ids, mask = left_pad(rows, eos_id)
    recorder = TopKRecorder(k)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        logits_processor=LogitsProcessorList([recorder]),
        pad_token_id=eos_id,
        eos_token_id=eos_id,
    )
    generated = out[:, ids.shape[1] :]
    top_ids = torch.stack([s[0] for s in recorder.steps], dim=1)
    top_lp = torch.stack([s[1] for s in recorder.steps], dim=1)
    records = []
    for i, row in enumerate(rows):
        n = reply_length(generated[i], eos_id)
        sequence = torch.tensor(row + generated[i, :n].tolist(), dtype=torch.int32)
        records.append(Record(sequence, len(row), top_ids[i, :n].clone(), top_lp[i, :n].clone()))
    return records


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
    logprobs = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
    values, indices = logprobs.topk(k, dim=-1)
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
