"""`multiguess distill` end to end: data job, training, export with evaluation and provenance.

Every stage resumes from what is already in the work folder, so the same command can be rerun
after an interruption and continues rather than starts over.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from multiguess.distill.dataset import DataPlan, load_teacher, run_data_job
from multiguess.distill.evaluate import cost_ratio, quality
from multiguess.distill.shards import read_shards
from multiguess.distill.student import DraftShape, build_draft
from multiguess.distill.train import TrainConfig, train
from multiguess.models.draft_vocab import count_tokens, most_frequent, write_draft_vocab
from multiguess.provenance import git_commit

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)
EVAL_DURING_TRAINING = 32


@dataclass(frozen=True)
class DistillPlan:
    target: Path
    work: Path
    out: Path
    data: DataPlan = field(default_factory=DataPlan)
    shape: DraftShape = field(default_factory=DraftShape)
    training: TrainConfig = field(default_factory=TrainConfig)
    data_minutes: float = 30.0
    train_minutes: float | None = None
    reply_weight: int = 2
    draft_vocab: int = 8192  # tokens the exported draft scores (0: all; models/draft_vocab.py)
    dtype: str = "bfloat16"
    text_roots: tuple[Path, ...] | None = None


def read_data(work: Path) -> tuple[list, list, list]:
    """(reply records, text records, held-out records) from the data stage's shards."""
    data = work / "data"
    replies, text, heldout = read_shards(data, "gen"), read_shards(data, "text"), read_shards(data, "heldout")
    if not replies and not text:
        raise FileNotFoundError(f"no training shards in {data}: run the data stage first")
    if not heldout:
        raise FileNotFoundError(f"no held-out shards in {data}: run the data stage first")
    return replies, text, heldout


def data_counts(replies: list, text: list, heldout: list) -> dict[str, int]:
    return {
        "reply_sequences": len(replies),
        "reply_tokens": sum(len(r.topk_ids) for r in replies),
        "text_sequences": len(text),
        "text_tokens": sum(len(r.topk_ids) for r in text),
        "heldout_sequences": len(heldout),
        "heldout_tokens": sum(len(r.topk_ids) for r in heldout),
    }


def run_training(plan: DistillPlan) -> dict:
    """Train (or resume) the draft; returns the best checkpoint's held-out metrics."""
    target, tokenizer = load_teacher(plan.target, "float32")
    replies, text, heldout = read_data(plan.work)
    records = replies * plan.reply_weight + text  # replies repeated ``reply_weight`` times
    draft = build_draft(target, plan.shape, plan.training.seed)
    del target
    pad_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    probe = heldout[:EVAL_DURING_TRAINING]
    deadline = time.monotonic() + plan.train_minutes * 60 if plan.train_minutes else None
    return train(
        draft,
        records,
        plan.training,
        plan.work / "train",
        pad_id,
        lambda model: quality(model, probe, pad_id, autocast=plan.training.bf16_autocast),
        deadline,
    )


def export(plan: DistillPlan, command: str) -> dict:
    """Write the best draft (bf16 safetensors + the target's tokenizer), its evaluation and provenance."""
    from transformers import AutoModelForCausalLM

    target, tokenizer = load_teacher(plan.target, plan.dtype)
    replies, text, heldout = read_data(plan.work)
    draft = build_draft(target, plan.shape, plan.training.seed)
    draft.load_state_dict(torch.load(plan.work / "train" / "best.pt", weights_only=True))
    staging = plan.out.with_name(plan.out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    draft.to(getattr(torch, plan.dtype)).save_pretrained(str(staging), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (plan.target / name).is_file():
            shutil.copy(plan.target / name, staging / name)
    vocab = export_draft_vocab(plan.draft_vocab, replies or text, staging)
    shipped = AutoModelForCausalLM.from_pretrained(str(staging), dtype=getattr(torch, plan.dtype)).eval()
    pad_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    metrics = {**quality(shipped, heldout, pad_id, vocab=vocab), **cost_ratio(shipped, target)}
    metrics |= {"dtype": plan.dtype, "draft_vocab": len(vocab) if vocab is not None else None}
    checkpoint = torch.load(plan.work / "train" / "checkpoint.pt", weights_only=False)
    provenance = {
        "command": command,
        "commands": (plan.work / "commands.txt").read_text().splitlines(),
        "git_commit": git_commit(),
        "target": str(plan.target),
        "data": data_counts(replies, text, heldout),
        "data_plan": asdict(plan.data),
        "reply_weight": plan.reply_weight,
        "shape": asdict(plan.shape),
        "training": asdict(plan.training),
        "trained_steps": checkpoint["step"],
        "best_step": checkpoint["best"]["step"],
        "metrics": metrics,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (staging / "PROVENANCE.md").write_text(provenance_markdown(provenance))
    publish(staging, plan.out, metrics, provenance)
    return provenance


def publish(staging: Path, out: Path, metrics: dict, provenance: dict) -> None:
    """Write an export's ``eval.json`` and ``provenance.json`` into ``staging``, then put it in
    place of ``out`` by a rename (a reader never sees half an export)."""
    (staging / "eval.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (staging / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)


def export_draft_vocab(size: int, records: list, folder: Path) -> torch.Tensor | None:
    """Write the draft's vocabulary: the ``size`` tokens most frequent in ``records``' labels
    (the target's replies, what it emits when serving, or the text when there are none)."""
    if not size:
        return None
    counts = count_tokens(r.ids[r.start :].tolist() for r in records)
    token_ids = most_frequent(counts, size)
    source = f"the {len(token_ids)} most frequent of {sum(counts.values())} labelled tokens"
    write_draft_vocab(folder, token_ids, source)
    return torch.tensor(token_ids)


def provenance_markdown(p: dict) -> str:
    """A human-readable rendering of provenance.json."""
    m, d = p["metrics"], p["data"]
    coverage = " / ".join(f"{m[f'top{k}_coverage']:.3f}" for k in range(1, 5))
    return (
        "# Provenance of this draft\n\n"
        f"Distilled from `{Path(p['target']).name}` by `multiguess distill` at commit `{p['git_commit']}` "
        f"({p['created']}).\n\n"
        "## Reproduce\n\n"
        "The commands that made it, in order (later runs resume from the earlier ones' shards and "
        "checkpoints in the same work folder):\n\n"
        "```\n" + "\n".join(p["commands"]) + "\n```\n\n"
        "## Data (the target as teacher, top-k log-probabilities per position)\n\n"
        f"- target's greedy replies to training prompts: {d['reply_sequences']} replies, "
        f"{d['reply_tokens']} tokens (weighted x{p['reply_weight']})\n"
        f"- teacher-forced local text (docs, licences, Python sources): {d['text_sequences']} passages, "
        f"{d['text_tokens']} tokens\n"
        f"- held-out evaluation (replies to prompts on held-out topics): {d['heldout_sequences']} replies, "
        f"{d['heldout_tokens']} tokens\n\n"
        "## Model and training\n\n"
        f"- shape: `{json.dumps(p['shape'])}`\n"
        f"- training: `{json.dumps(p['training'])}`\n"
        f"- steps trained: {p['trained_steps']}, best held-out checkpoint at step {p['best_step']}\n\n"
        "## Held-out metrics\n\n"
        f"- greedy acceptance: {m['acceptance']:.3f}\n"
        f"- top-1..4 coverage: {coverage}\n"
        f"- chain (depth 4) tokens per verify step: {m['chain4_tokens_per_step']:.2f}\n"
        + (
            f"- scored over its draft vocabulary of {m['draft_vocab']} tokens\n"
            if m.get("draft_vocab")
            else ""
        )
        + f"- decode cost: draft {m['draft_ms_per_token']:.2f} ms vs target {m['target_ms_per_token']:.2f} ms "
        f"per token = {m['cost_ratio']:.3f} ({m['dtype']}, {m['threads']} thread(s))\n"
    )


def run(plan: DistillPlan, stages: tuple[str, ...], command: str) -> dict | None:
    """Run the requested stages in order (data, train, export).

    Each invocation is appended to ``work/commands.txt``: a draft is often made by several resumed
    runs, and its provenance must list all of them to be reproducible.
    """
    plan.work.mkdir(parents=True, exist_ok=True)
    with (plan.work / "commands.txt").open("a") as log:
        log.write(command + "\n")
    if "data" in stages:
        run_data_job(plan.target, plan.work, plan.data, plan.dtype, plan.data_minutes, plan.text_roots)
    if "train" in stages:
        best = run_training(plan)
        print(f"distill: best held-out probe {json.dumps(best)}", file=sys.stderr)
    if "export" in stages:
        return export(plan, command)
    return None
