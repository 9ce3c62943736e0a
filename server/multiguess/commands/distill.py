"""`multiguess distill`: train a small draft for a target from the target's own outputs."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

STAGES = ("data", "train", "export")


def stage_list(value: str) -> tuple[str, ...]:
    stages = tuple(s.strip() for s in value.split(",") if s.strip())
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages:
        raise argparse.ArgumentTypeError(f"stages must be a comma-separated subset of {','.join(STAGES)}")
    return stages


def positive_int(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return number


def non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return number


def positive_float(value: str) -> float:
    number = float(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return number


def canonical_command(args: argparse.Namespace) -> str:
    """The command with every option spelled out, so provenance stays exact if defaults change."""
    words = ["multiguess", "distill"]
    for name, value in vars(args).items():
        if name in ("command", "func") or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if name == "stages":
            words += [flag, ",".join(value)]
        elif isinstance(value, list):
            for item in value:
                words += [flag, str(item)]
        else:
            words += [flag, str(value)]
    return shlex.join(words)


METHODS = ("draft", "eagle3")
LEARNING_RATES = {"draft": 2e-3, "eagle3": 1e-3}
TOKENS_PER_STEP = {"draft": 2048, "eagle3": 1024}


def run(args: argparse.Namespace) -> int:
    import torch

    from multiguess.distill.dataset import DataPlan
    from multiguess.distill.pipeline import DistillPlan
    from multiguess.distill.pipeline import run as run_pipeline
    from multiguess.distill.student import DraftShape
    from multiguess.distill.train import TrainConfig
    from multiguess.models.embedded import prepare_target

    torch.set_num_threads(args.threads)
    target = args.target or prepare_target()
    if not (target / "config.json").is_file():
        print(f"multiguess distill: {target} is not a model folder (no config.json)", file=sys.stderr)
        return 2
    if args.width % args.heads:
        print(
            f"multiguess distill: --width {args.width} must be a multiple of --heads {args.heads}",
            file=sys.stderr,
        )
        return 2
    args.lr = args.lr or LEARNING_RATES[args.method]
    args.tokens_per_step = args.tokens_per_step or TOKENS_PER_STEP[args.method]
    data = DataPlan(
        batch=args.gen_batch,
        max_new_tokens=args.max_new_tokens,
        heldout_prompts=args.heldout,
        text_every=args.text_every,
    )
    training = TrainConfig(steps=args.steps, tokens_per_step=args.tokens_per_step, lr=args.lr)
    if args.method == "eagle3":
        return run_eagle3(args, target, data, training)
    plan = DistillPlan(
        target=target,
        work=args.work,
        out=args.out,
        data=data,
        shape=DraftShape(
            hidden_size=args.width,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            intermediate_size=args.intermediate,
        ),
        training=training,
        data_minutes=args.data_minutes,
        train_minutes=args.train_minutes,
        reply_weight=args.reply_weight,
        draft_vocab=args.draft_vocab,
        text_roots=tuple(args.text_root) if args.text_root else None,
    )
    command = canonical_command(args)
    provenance = run_pipeline(plan, args.stages, command)
    if provenance is not None:
        print(json.dumps(provenance["metrics"], indent=2))
    return 0


def run_eagle3(args: argparse.Namespace, target: Path, data: object, training: object) -> int:
    from multiguess.distill.eagle3_pipeline import Eagle3Plan
    from multiguess.distill.eagle3_pipeline import run as run_pipeline

    plan = Eagle3Plan(
        target=target,
        work=args.work,
        out=args.out,
        data=data,
        training=training,
        data_minutes=args.data_minutes,
        train_minutes=args.train_minutes,
        reply_weight=args.reply_weight,
        draft_vocab=args.draft_vocab,
        ttt_steps=args.ttt_steps,
        compare_draft=args.compare_draft,
        text_roots=tuple(args.text_root) if args.text_root else None,
    )
    provenance = run_pipeline(plan, args.stages, canonical_command(args))
    if provenance is not None:
        print(json.dumps(provenance["metrics"], indent=2))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "distill",
        help="train a small draft model or an EAGLE-3 head from a target's own outputs (self-distillation)",
        description="Stages: data (the target's greedy replies to a diverse prompt set and its top-k "
        "distributions over local text, in resumable shards; with --method eagle3 also the target's "
        "hidden states at the head's layers), train (teacher-forced distillation, or training-time "
        "test for a head, with resumable checkpoints), export (bf16 safetensors + eval.json + "
        "provenance; a draft also gets the tokenizer, a head the LlamaForCausalLMEagle3 layout). "
        "Rerunning the same command resumes.",
    )
    parser.add_argument(
        "--method",
        choices=METHODS,
        default="draft",
        help="draft: a small separate LM; eagle3: a feature-level EAGLE-3 head on the target's hidden "
        "states (exported in the LlamaForCausalLMEagle3 layout)",
    )
    parser.add_argument("--target", type=Path, default=None, help="target model folder (default: embedded)")
    parser.add_argument("--work", type=Path, default=Path("runs/distill"), help="shards and checkpoints")
    parser.add_argument("--out", type=Path, default=Path("runs/distill/draft"), help="exported draft folder")
    parser.add_argument(
        "--stages", type=stage_list, default=STAGES, help="comma-separated: data,train,export"
    )
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--data-minutes", type=positive_float, default=30.0, help="time budget of the data stage"
    )
    parser.add_argument(
        "--text-root",
        type=Path,
        action="append",
        help="folder of .md/.rst/.txt/.py text (repeatable; default: docs, licences, Python sources)",
    )
    parser.add_argument("--gen-batch", type=positive_int, default=48, help="prompts per generation batch")
    parser.add_argument("--max-new-tokens", type=positive_int, default=192, help="reply length cap")
    parser.add_argument("--heldout", type=positive_int, default=96, help="held-out prompts for evaluation")
    parser.add_argument(
        "--text-every",
        type=non_negative_int,
        default=4,
        help="text shards made after each reply shard (0: replies only; text is faster to make, "
        "replies are what the draft is judged on)",
    )
    parser.add_argument("--layers", type=positive_int, default=3)
    parser.add_argument("--width", type=positive_int, default=256)
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--kv-heads", type=positive_int, default=2)
    parser.add_argument("--intermediate", type=positive_int, default=768)
    parser.add_argument(
        "--steps", type=positive_int, default=2000, help="training steps (the LR schedule's length)"
    )
    parser.add_argument(
        "--train-minutes", type=positive_float, default=None, help="stop training earlier than --steps"
    )
    parser.add_argument(
        "--tokens-per-step",
        type=positive_int,
        default=None,
        help="labelled tokens per step (default: 2048 draft, 1024 eagle3)",
    )
    parser.add_argument(
        "--lr", type=positive_float, default=None, help="peak rate (default: 2e-3 draft, 1e-3 eagle3)"
    )
    parser.add_argument(
        "--ttt-steps",
        type=positive_int,
        default=3,
        help="eagle3: chained steps per position in training (training-time test)",
    )
    parser.add_argument(
        "--compare-draft",
        type=Path,
        default=None,
        help="eagle3: a model draft folder measured on the same held-out replies at export",
    )
    parser.add_argument(
        "--reply-weight", type=positive_int, default=2, help="how often replies repeat per epoch"
    )
    parser.add_argument(
        "--draft-vocab",
        type=non_negative_int,
        default=8192,
        help="tokens the exported draft scores: the most frequent in the target's replies "
        "(draft_vocab.json; 0: every token)",
    )
    parser.set_defaults(func=run)
