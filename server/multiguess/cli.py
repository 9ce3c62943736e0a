"""The `multiguess` command line: a thin dispatcher over `multiguess.commands.<name>` modules.

Each command lives in its own module exposing ``register(subparsers)``, which adds a subparser
and sets ``func`` (``args -> exit code``). Commands import their heavy dependencies (torch,
transformers, uvicorn) lazily, so ``multiguess --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

SERVING_COMMANDS = ("serve", "serve-draft")
COMMANDS: tuple[str, ...] = ("embedded", "generate", "serve", "serve_draft", "distill", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="multiguess", description="Lossless multi-candidate speculative decoding."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"multiguess.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    if words and words[0] in SERVING_COMMANDS:
        # A server's HTTP threads share the cores with torch's OpenMP threads. OpenMP threads
        # that spin while waiting then wait for a preempted sibling in every parallel region:
        # measured 16x slower decoding on a busy 2-core machine, against 1.2x with passive
        # waiting (which costs ~1.5x on an idle machine, hence servers only). Set before torch
        # loads its OpenMP runtime; an explicit setting wins.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
