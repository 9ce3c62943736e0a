"""The training loop: teacher-forced distillation of the draft on the teacher's records.

Resumable: the batch order is a pure function of (seed, epoch), and a checkpoint holds the
model, optimiser and step, so a restarted run continues exactly where it stopped.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from multiguess.distill.loss import sampled_topk_soft_cross_entropy, topk_soft_cross_entropy
from multiguess.distill.teacher import Record


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 2000
    tokens_per_step: int = 2048
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_seconds: float = 300.0
    log_every: int = 10
    bf16_autocast: bool = True
    sampled_negatives: int = 4096  # 0: softmax over the whole vocabulary


@dataclass
class Batch:
    ids: torch.Tensor  # long [B, W], right-padded
    mask: torch.Tensor  # long [B, W]
    rows: torch.Tensor  # long [N] batch row of each labelled position
    cols: torch.Tensor  # long [N] position (the one predicting the next token)
    topk_ids: torch.Tensor  # int32 [N, k]
    topk_logprobs: torch.Tensor  # float16 [N, k]


def collate(records: Sequence[Record], pad_id: int) -> Batch:
    """Right-pad sequences and list every labelled (row, position) with its teacher top-k."""
    width = max(len(r.ids) for r in records)
    ids = torch.full((len(records), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(records), width), dtype=torch.long)
    rows, cols = [], []
    for i, r in enumerate(records):
        ids[i, : len(r.ids)] = r.ids.long()
        mask[i, : len(r.ids)] = 1
        positions = torch.arange(r.start - 1, len(r.ids) - 1)
        rows.append(torch.full_like(positions, i))
        cols.append(positions)
    return Batch(
        ids,
        mask,
        torch.cat(rows),
        torch.cat(cols),
        torch.cat([r.topk_ids for r in records]),
        torch.cat([r.topk_logprobs for r in records]),
    )


def epoch_batches(records: Sequence[Record], tokens_per_step: int, seed: int, epoch: int) -> list[list[int]]:
    """Record indices per step: shuffled, then length-sorted in windows to limit padding."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(records)))
    rng.shuffle(order)
    window = 256
    order = [
        i
        for w in range(0, len(order), window)
        for i in sorted(order[w : w + window], key=lambda j: len(records[j].ids))
    ]
    batches: list[list[int]] = []
    current: list[int] = []
    labelled = 0
    for i in order:
        current.append(i)
        labelled += len(records[i].topk_ids)
        if labelled >= tokens_per_step:
            batches.append(current)
            current, labelled = [], 0
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def batch_stream(records: Sequence[Record], config: TrainConfig, start_step: int) -> Iterator[list[int]]:
    """Step ``start_step`` onwards of the endless epoch sequence."""
    step, epoch = 0, 0
    while True:
        for batch in epoch_batches(records, config.tokens_per_step, config.seed, epoch):
            if step >= start_step:
                yield batch
            step += 1
        epoch += 1


def learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` of the peak at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps))
    return config.lr * (
        config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )


def labelled_hidden(model, batch: Batch, autocast: bool) -> torch.Tensor:
    """Final hidden states at labelled positions only: the context needs no vocabulary projection."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        hidden = model.model(input_ids=batch.ids, attention_mask=batch.mask).last_hidden_state
        return hidden[batch.rows, batch.cols]


def draft_logits(model, batch: Batch, autocast: bool) -> torch.Tensor:
    """Full-vocabulary logits at labelled positions."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return model.lm_head(labelled_hidden(model, batch, autocast))


def train_step(model, optimizer, batch: Batch, config: TrainConfig, lr: float) -> dict[str, float]:
    for group in optimizer.param_groups:
        group["lr"] = lr
    if config.sampled_negatives:
        hidden = labelled_hidden(model, batch, config.bf16_autocast)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16_autocast):
            loss, hits = sampled_topk_soft_cross_entropy(
                hidden, model.lm_head.weight, batch.topk_ids, batch.topk_logprobs, config.sampled_negatives
            )
    else:
        logits = draft_logits(model, batch, config.bf16_autocast)
        loss = topk_soft_cross_entropy(logits, batch.topk_ids, batch.topk_logprobs)
        hits = logits.detach().argmax(dim=-1) == batch.topk_ids[:, 0]
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    optimizer.step()
    return {"loss": loss.item(), "top1": hits.float().mean().item(), "tokens": len(batch.rows)}


def make_optimizer(model, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms (1-d parameters)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.98))


def save_checkpoint(path: Path, model, optimizer, step: int, extra: dict) -> None:
    """Atomic: a crash mid-write leaves the previous checkpoint intact."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, **extra}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, model, optimizer) -> dict:
    state = torch.load(path, weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state


def train(
    model,
    records: Sequence[Record],
    config: TrainConfig,
    work: Path,
    pad_id: int,
    evaluate: Callable[[object], dict[str, float]],
    deadline: float | None = None,
    step_on: Callable[[torch.optim.Optimizer, list[int], float], dict[str, float]] | None = None,
) -> dict:
    """Train until ``config.steps`` (or ``deadline``, monotonic); resume from ``work/checkpoint.pt``.

    ``evaluate(model)`` runs at every checkpoint; the model with the best held-out greedy
    acceptance so far is kept in ``work/best.pt``. Progress goes to ``work/train.log`` (JSON lines).
    ``step_on(optimizer, record indices, lr)`` trains one batch (default: a draft's ``train_step``),
    returning its loss, top-1 and labelled tokens.
    """
    work.mkdir(parents=True, exist_ok=True)
    checkpoint, best_path, log_path = work / "checkpoint.pt", work / "best.pt", work / "train.log"
    torch.manual_seed(config.seed)
    optimizer = make_optimizer(model, config)
    step, best = 0, {"acceptance": -1.0}
    if checkpoint.exists():
        state = load_checkpoint(checkpoint, model, optimizer)
        step, best = state["step"], state["best"]
        print(f"distill train: resuming at step {step}", file=sys.stderr, flush=True)
    model.train()
    stream = batch_stream(records, config, step)
    last_save, window = (
        time.monotonic(),
        {"loss": 0.0, "top1": 0.0, "tokens": 0, "n": 0, "t": time.monotonic()},
    )

    def checkpoint_now() -> None:
        nonlocal best, last_save
        model.eval()
        metrics = evaluate(model)
        model.train()
        if metrics["acceptance"] > best["acceptance"]:
            best = {**metrics, "step": step}
            torch.save(model.state_dict(), best_path.with_suffix(".tmp"))
            os.replace(best_path.with_suffix(".tmp"), best_path)
        save_checkpoint(checkpoint, model, optimizer, step, {"best": best, "config": asdict(config)})
        append_log(log_path, {"step": step, "eval": metrics, "best_step": best["step"]})
        last_save = time.monotonic()

    while step < config.steps and (deadline is None or time.monotonic() < deadline):
        indices, lr = next(stream), learning_rate(config, step)
        if step_on is None:
            stats = train_step(model, optimizer, collate([records[i] for i in indices], pad_id), config, lr)
        else:
            stats = step_on(optimizer, indices, lr)
        step += 1
        for key in ("loss", "top1"):
            window[key] += stats[key]
        window["tokens"] += stats["tokens"]
        window["n"] += 1
        if step % config.log_every == 0:
            elapsed = time.monotonic() - window["t"]
            entry = {
                "step": step,
                "loss": window["loss"] / window["n"],
                "top1": window["top1"] / window["n"],
                "tokens_per_s": window["tokens"] / elapsed,
                "lr": learning_rate(config, step),
            }
            append_log(log_path, entry)
            print(f"distill train: {json.dumps(entry)}", file=sys.stderr, flush=True)
            window = {"loss": 0.0, "top1": 0.0, "tokens": 0, "n": 0, "t": time.monotonic()}
        if time.monotonic() - last_save > config.checkpoint_seconds:
            checkpoint_now()
    checkpoint_now()
    return best


def append_log(path: Path, entry: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")
