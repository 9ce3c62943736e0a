"""The distillation data job: held-out replies for evaluation, then training replies and text.

Replies (batched greedy generation) are what the draft must predict at serving time but are
slow to make; teacher-forced text is much cheaper per token (docs/DRAFT.md). The job interleaves the two so that
whenever it is stopped the data holds both, and every shard it writes survives a restart.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from multiguess.distill import corpus, prompts
from multiguess.distill.shards import fill_shards
from multiguess.distill.teacher import reply_records, teacher_forced_records

TEXT_INSTRUCTIONS = (
    "Write a passage of technical documentation.",
    "Explain this topic in detail.",
    "Write the next part of the text.",
    "Tell me about it.",
)
CODE_INSTRUCTIONS = ("Write some Python code.", "Show me an example implementation in Python.")
MAX_PROMPT_TOKENS = 384  # a prompt's last tokens kept for replies; sizes the teacher's cache


@dataclass(frozen=True)
class DataPlan:
    """How much of each kind to make; the lists are deterministic given the machine's files."""

    k: int = 16
    batch: int = 48
    max_new_tokens: int = 192
    heldout_prompts: int = 96
    text_batch: int = 8
    text_every: int = 4
    seed: int = 0


def build_prompt_sets(plan: DataPlan, prose: list[str], code: list[str]) -> tuple[list[str], list[str]]:
    """(train prompts, held-out prompts): templates plus summarise/explain prompts over local text."""
    rng = random.Random(plan.seed)
    snippets = [c[:900] for c in rng.sample(prose, min(len(prose), 3000))]
    snippets += [c[:700] for c in rng.sample(code, min(len(code), 1500))]
    train, heldout = prompts.split_prompts(prompts.template_prompts() + prompts.snippet_prompts(snippets))
    return [p.text for p in train], [p.text for p in heldout[: plan.heldout_prompts]]


def text_pairs(plan: DataPlan, prose: list[str], code: list[str]) -> list[tuple[str, str]]:
    """Plain text framed as assistant replies, so the teacher sees the chat context it serves in."""
    rng = random.Random(plan.seed + 1)
    pairs = [(rng.choice(TEXT_INSTRUCTIONS), c) for c in prose]
    pairs += [(rng.choice(CODE_INSTRUCTIONS), c) for c in rng.sample(code, min(len(code), 4 * len(prose)))]
    rng.shuffle(pairs)
    return pairs


def batched(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def load_teacher(target: Path, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=getattr(torch, dtype)).eval()
    return model, AutoTokenizer.from_pretrained(str(target))


def teacher_runner(model, tokenizer, target: Path, plan: DataPlan):
    """The engine's own forward over the teacher's weights, one cache slot per batch row."""
    import torch
    from multiguess.engine.loaded_model import LoadedModel
    from multiguess.engine.runner import NativeRunner

    loaded = LoadedModel(model, tokenizer, str(target), torch.device("cpu"), model.dtype)
    return NativeRunner(loaded, plan.batch, MAX_PROMPT_TOKENS + plan.max_new_tokens)


def run_data_job(
    target: Path, work: Path, plan: DataPlan, dtype: str, minutes: float, roots: Sequence[Path] | None = None
) -> None:
    """Fill ``work/data`` with held-out replies first, then training replies and text until ``minutes``.

    ``roots`` are the folders searched for text (default: docs, licences, Python sources).
    """
    model, tokenizer = load_teacher(target, dtype)
    runner = teacher_runner(model, tokenizer, target, plan)
    roots = roots or corpus.default_roots()
    prose = corpus.collect_chunks(roots, corpus.TEXT_SUFFIXES, prose_only=True)
    code = corpus.collect_chunks(roots, (".py",), prose_only=False)
    train, heldout = build_prompt_sets(plan, prose, code)
    pairs = text_pairs(plan, prose, code)
    data = work / "data"
    deadline = time.monotonic() + minutes * 60

    def replies(batch: list[str]) -> list:
        return reply_records(runner, tokenizer, batch, plan.max_new_tokens, plan.k, MAX_PROMPT_TOKENS)

    def forced(batch: list[tuple[str, str]]) -> list:
        return teacher_forced_records(model, tokenizer, batch, plan.k)

    for index in fill_shards(data, "heldout", batched(heldout, plan.batch), replies):
        print(f"distill data: heldout shard {index}", file=sys.stderr, flush=True)
    gen = fill_shards(data, "gen", batched(train, plan.batch), replies, deadline)
    text = fill_shards(data, "text", batched(pairs, plan.text_batch), forced, deadline)
    for kind, index in interleave(gen, text, plan.text_every):
        print(
            f"distill data: {kind} shard {index} ({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True
        )


def interleave(gen: Iterator[int], text: Iterator[int], text_every: int) -> Iterator[tuple[str, int]]:
    """One reply shard, then ``text_every`` text shards, until either source is done."""
    while True:
        index = next(gen, None)
        if index is None:
            return
        yield "gen", index
        for _ in range(text_every):
            index = next(text, None)
            if index is None:
                return
            yield "text", index
