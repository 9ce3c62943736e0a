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
    if words and words[0] in SERVING_COMMANDS and "OMP_WAIT_POLICY" not in os.environ:
        # A server's HTTP threads share the cores with torch's OpenMP threads. OpenMP's default
        # spin (300k iterations) waits for a preempted sibling in every parallel region, which
        # stalls decode steps when the cores are shared; passive waiting puts threads to sleep
        # between ops, which slows them on idle cores. A short spin avoids both (measured in
        # docs/ENGINE.md, "OpenMP waiting"). Set before torch loads its OpenMP runtime; an
        # explicit setting of either variable wins.
        os.environ.setdefault("GOMP_SPINCOUNT", "50000")
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
