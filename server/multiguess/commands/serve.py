"""`multiguess serve`: the HTTP server. Every flag can also come from ``MULTIGUESS_<FLAG>``.

Pods are configured through environment variables (the operator sets them), people through
flags; a flag on the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ENV_PREFIX = "MULTIGUESS_"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_LEVELS = ("debug", "info", "warning", "error")


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def add(
    parser: argparse.ArgumentParser, flag: str, kind: Callable[[str], Any], default: Any, text: str
) -> None:
    """A flag whose default comes from its environment variable. argparse converts a string
    default with ``type`` as if typed, so a bad value fails with the flag's own message."""
    raw = os.environ.get(env_name(flag))
    value = default if raw is None or raw == "" else raw
    parser.add_argument(flag, type=kind, default=value, help=f"{text} (env {env_name(flag)})")


def served_name(args: argparse.Namespace) -> str:
    if args.model_name:
        return str(args.model_name)
    return Path(args.target.rstrip("/")).name if args.target else "multiguess-default"


def build_engine(args: argparse.Namespace, registry: Any = None) -> Any:
    """Load the pair and wrap the drafter in the guard (runs on the engine's worker thread).

    With ``--draft-url`` no draft is loaded here: a remote drafter asks the draft server
    (``multiguess serve-draft``), bounding each step by ``--draft-step-timeout`` itself; its
    metrics go to ``registry``.
    """
    from multiguess.engine.engine import Engine, EngineConfig
    from multiguess.engine.guard import GuardedDrafter
    from multiguess.llm import load_pair

    config = EngineConfig(args.num_candidates, args.depth, args.max_nodes, args.max_batch, args.max_model_len)
    remote = bool(args.draft_url)
    target, draft = load_pair(
        args.target,
        args.draft,
        args.dtype,
        args.device,
        args.draft_device,
        args.draft_quantization,
        speculate=not remote,
    )
    drafter = None
    if remote:
        from multiguess.remote.client import RemoteDrafter

        drafter = RemoteDrafter(
            args.draft_url, target.tokenizer, step_timeout=args.draft_step_timeout, registry=registry
        )
    engine = Engine(target, draft, config, drafter=drafter)
    if engine.drafter is not None:
        engine.drafter = GuardedDrafter(engine.drafter, args.draft_step_timeout, args.draft_cooldown)
    return engine


def make_server(args: argparse.Namespace) -> Any:
    import uvicorn

    from multiguess.api import ServerSettings, create_app

    settings = ServerSettings(served_name(args), args.max_queue, args.request_timeout)
    app = create_app(lambda: build_engine(args, app.state.metrics.registry), settings)

    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT: readiness fails and new requests get 503 at once, in-flight ones
        finish (up to the grace period), then the process exits 0 instead of re-raising."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            scheduler = getattr(app.state, "scheduler", None)
            if scheduler is not None:
                scheduler.drain()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGTERM, signal.SIGINT)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=int(args.shutdown_grace),
    )
    return DrainingServer(config)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    make_server(args).run()
    return 0


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be > 0")
    return value


def log_level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}")
    return text.lower()


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions, /generate, /health/*, /metrics. "
        "Without --target: the embedded default pair.",
    )
    add(parser, "--target", str, None, "target model folder or hub id")
    add(parser, "--draft", str, None, "draft model folder (none: plain decoding)")
    add(parser, "--draft-quantization", str, None, "draft quantization: none or int8")
    add(parser, "--draft-device", str, None, "draft device (default: --device)")
    add(parser, "--draft-url", str, None, "draft server (multiguess serve-draft) instead of a local draft")
    add(parser, "--dtype", str, "auto", "auto, bfloat16, float16 or float32")
    add(parser, "--device", str, "cpu", "cpu or cuda[:N]")
    add(parser, "--num-candidates", int, 3, "tree width: candidates per expanded node")
    add(parser, "--depth", int, 4, "tree depth (0: no speculation)")
    add(parser, "--max-nodes", int, 16, "drafted nodes per tree")
    add(parser, "--max-batch", int, 8, "sequences decoded together")
    add(parser, "--max-model-len", int, 2048, "context length: prompt + generated tokens")
    add(parser, "--host", str, "0.0.0.0", "address to listen on")
    add(parser, "--port", int, 8000, "port to listen on")
    add(parser, "--max-queue", int, 64, "waiting requests before 429")
    add(parser, "--request-timeout", positive_float, 600.0, "seconds per request, queue + generation")
    add(parser, "--shutdown-grace", positive_float, 30.0, "seconds in-flight requests get after SIGTERM")
    add(parser, "--draft-step-timeout", positive_float, 2.0, "seconds a draft step may take")
    add(parser, "--draft-cooldown", float, 30.0, "seconds speculation pauses after a draft failure")
    add(parser, "--model-name", str, None, "served model name (default: target folder name)")
    add(parser, "--log-level", log_level, "info", "debug, info, warning or error")
    parser.set_defaults(func=run)
