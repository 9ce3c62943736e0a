"""`multiguess embedded`: prepare the embedded default pair and print where it lives, as JSON."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path


def run(args: argparse.Namespace) -> int:
    from multiguess.models.embedded import prepare_embedded, prepare_target

    models = prepare_embedded(args.cache)
    fields = {key: str(value) if isinstance(value, Path) else value for key, value in asdict(models).items()}
    fields["target_bf16"] = str(prepare_target(args.cache))
    print(json.dumps(fields))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "embedded",
        help="prepare the embedded default target/draft pair and print their paths as JSON",
        description="Caches the embedded target GGUF's config and tokenizer (CPUs serve the file as "
        "shipped) and converts it to bf16 safetensors for GPUs and --quantization none, each on "
        'first use, then prints {"target", "draft", "draft_quantization", "dtype", "target_bf16"} as JSON.',
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="cache folder (default: $MULTIGUESS_CACHE or ~/.cache/multiguess)",
    )
    parser.set_defaults(func=run)
