"""`multiguess distill --method eagle3`: the target's records and features, head training, export.

Stages, each resuming from what the work folder already holds:

1. **data**: the draft distillation's data job (``dataset.py``: held-out replies, training
   replies, teacher-forced text, top-k at every labelled position), then the target's features
   for every record (``eagle3_features.py``) in ``work/eagle3/features``. The two methods share
   the data shards.
2. **train**: training-time-test training of the head (``eagle3_train.py``) through the
   resumable loop of ``train.py``: checkpoints, a held-out probe and ``best.pt`` in
   ``work/eagle3/train``, progress in its ``train.log``.
3. **export**: the best head in the ``LlamaForCausalLMEagle3`` layout
   (``models/eagle3_checkpoint.py``), its held-out evaluation (``eval.json``, with a model
   draft's measured on the same replies when one is given) and provenance.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from multiguess.distill.dataset import DataPlan, load_teacher, run_data_job
from multiguess.distill.eagle3_features import read_features, run_features_job
from multiguess.distill.eagle3_train import (
    build_head,
    collate_head,
    frozen_embedding,
    head_quality,
    target_to_draft_index,
    ttt_hidden,
    ttt_loss,
)
from multiguess.distill.evaluate import quality
from multiguess.distill.pipeline import EVAL_DURING_TRAINING, publish
from multiguess.distill.train import TrainConfig, train
from multiguess.engine.eagle3_head import Eagle3Head, default_aux_layers
from multiguess.models.draft_vocab import count_tokens, load_draft_vocab, most_frequent
from multiguess.models.eagle3_checkpoint import config_from_dict, read_weights, save_head
from multiguess.provenance import git_commit


@dataclass(frozen=True)
class Eagle3Plan:
    target: Path
    work: Path
    out: Path
    data: DataPlan = field(default_factory=DataPlan)
    training: TrainConfig = field(default_factory=lambda: TrainConfig(lr=1e-3, tokens_per_step=1024))
    data_minutes: float = 30.0
    train_minutes: float | None = None
    reply_weight: int = 2
    draft_vocab: int = 8192  # tokens the head scores (0: every token)
    ttt_steps: int = 3  # chained steps per position in training (training-time test)
    eval_depth: int = 4
    compare_draft: Path | None = None  # a model draft measured on the same held-out replies
    dtype: str = "bfloat16"
    text_roots: tuple[Path, ...] | None = None

    @property
    def folder(self) -> Path:
        return self.work / "eagle3"


def head_vocabulary(size: int, records: list, vocab_size: int) -> torch.Tensor:
    """The ``size`` tokens most frequent in the records' labels (every token for 0)."""
    if not size or size >= vocab_size:
        return torch.arange(vocab_size)
    counts = count_tokens(r.ids[r.start :].tolist() for r in records)
    return torch.tensor(most_frequent(counts, size))


def run_data(plan: Eagle3Plan) -> None:
    run_data_job(plan.target, plan.work, plan.data, plan.dtype, plan.data_minutes, plan.text_roots)
    model, tokenizer = load_teacher(plan.target, plan.dtype)
    layers = default_aux_layers(model.config.num_hidden_layers)
    pad_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    run_features_job(model, plan.work / "data", plan.folder / "features", layers, pad_id)


def training_data(plan: Eagle3Plan) -> dict[str, tuple[list, list]]:
    data, folder = plan.work / "data", plan.folder / "features"
    parts = {kind: read_features(data, folder, kind) for kind in ("gen", "text", "heldout")}
    if not parts["gen"][0] and not parts["text"][0]:
        raise FileNotFoundError(f"no features in {folder}: run the data stage first")
    if not parts["heldout"][0]:
        raise FileNotFoundError(f"no held-out features in {folder}: run the data stage first")
    return parts


def vocabulary_for(plan: Eagle3Plan, parts: dict[str, tuple[list, list]], vocab_size: int) -> torch.Tensor:
    """The head's draft vocabulary: the records' most frequent tokens when training starts, the
    checkpoint's once there is one (its LM head's rows were trained for those tokens, whatever
    data the data stage added since)."""
    checkpoint = plan.folder / "train" / "checkpoint.pt"
    if checkpoint.exists():
        d2t = torch.load(checkpoint, weights_only=False, mmap=True)["model"]["d2t"]
        return torch.arange(len(d2t)) + d2t
    return head_vocabulary(plan.draft_vocab, parts["gen"][0] or parts["text"][0], vocab_size)


def run_training(plan: Eagle3Plan) -> dict:
    """Train (or resume) the head; returns the best checkpoint's probe metrics."""
    target, tokenizer = load_teacher(plan.target, "float32")
    parts = training_data(plan)
    (replies, reply_features), (text, text_features) = parts["gen"], parts["text"]
    records = replies * plan.reply_weight + text
    features = reply_features * plan.reply_weight + text_features
    head = build_head(target, vocabulary_for(plan, parts, target.config.vocab_size), plan.training.seed)
    embed = frozen_embedding(target)
    del target
    pad_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    t2d_index = target_to_draft_index(head.draft_to_target, head.config.vocab_size)
    config = plan.training
    probe, probe_features = (part[:EVAL_DURING_TRAINING] for part in parts["heldout"])

    def step_on(optimizer: torch.optim.Optimizer, indices: list[int], lr: float) -> dict[str, float]:
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = collate_head([records[i] for i in indices], [features[i] for i in indices], t2d_index, pad_id)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16_autocast):
            loss, top1 = ttt_loss(head, ttt_hidden(head, embed, batch, plan.ttt_steps, pad_id), batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), config.grad_clip)
        optimizer.step()
        return {"loss": loss.item(), "top1": top1[0], "tokens": int(batch.in_vocab.sum())}

    def evaluate(model: object) -> dict[str, float]:
        return head_quality(head, embed, probe, probe_features, pad_id, plan.eval_depth, autocast=True)

    deadline = time.monotonic() + plan.train_minutes * 60 if plan.train_minutes else None
    return train(head, records, config, plan.folder / "train", pad_id, evaluate, deadline, step_on)


def export(plan: Eagle3Plan, command: str) -> dict:
    """Write the best head, its held-out evaluation and provenance into ``plan.out``."""
    target, tokenizer = load_teacher(plan.target, "float32")
    parts = training_data(plan)
    head = build_head(target, vocabulary_for(plan, parts, target.config.vocab_size), plan.training.seed)
    head.load_state_dict(torch.load(plan.folder / "train" / "best.pt", weights_only=True))
    staging = plan.out.with_name(plan.out.name + ".export")
    save_head(head, staging, getattr(torch, plan.dtype))
    pad_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    heldout, heldout_features = parts["heldout"]
    shipped = shipped_head(staging)
    metrics = head_quality(
        shipped, frozen_embedding(target), heldout, heldout_features, pad_id, plan.eval_depth
    )
    metrics |= {"dtype": plan.dtype, "draft_vocab": head.config.draft_vocab_size, "ttt_steps": plan.ttt_steps}
    if plan.compare_draft is not None:
        metrics["model_draft"] = draft_quality(plan.compare_draft, heldout, pad_id)
    checkpoint = torch.load(plan.folder / "train" / "checkpoint.pt", weights_only=False)
    provenance = {
        "command": command,
        "commands": (plan.work / "commands.txt").read_text().splitlines(),
        "git_commit": git_commit(),
        "target": str(plan.target),
        "data": {
            kind: {"sequences": len(r), "tokens": sum(len(x.topk_ids) for x in r)}
            for kind, (r, _) in parts.items()
        },
        "reply_weight": plan.reply_weight,
        "training": asdict(plan.training),
        "trained_steps": checkpoint["step"],
        "best_step": checkpoint["best"]["step"],
        "metrics": metrics,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    publish(staging, plan.out, metrics, provenance)
    return provenance


def shipped_head(folder: Path) -> Eagle3Head:
    """The exported head read back through the checkpoint loader, as serving reads it."""
    config = config_from_dict(json.loads((folder / "config.json").read_text()))
    head = Eagle3Head(config)
    head.load_state_dict(read_weights(folder))
    return head.float().eval()


def draft_quality(folder: Path, heldout: list, pad_id: int) -> dict[str, float]:
    """A model draft's held-out metrics on the same replies, over its own draft vocabulary."""
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    vocab = load_draft_vocab(str(folder), draft.config.vocab_size)
    return quality(draft, heldout, pad_id, vocab=vocab)


def run(plan: Eagle3Plan, stages: tuple[str, ...], command: str) -> dict | None:
    """The requested stages in order; every invocation is appended to ``work/commands.txt``."""
    plan.work.mkdir(parents=True, exist_ok=True)
    with (plan.work / "commands.txt").open("a") as log:
        log.write(command + "\n")
    if "data" in stages:
        run_data(plan)
    if "train" in stages:
        best = run_training(plan)
        print(f"distill eagle3: best held-out probe {json.dumps(best)}", file=sys.stderr)
    if "export" in stages:
        return export(plan, command)
    return None
