"""`multiguess serve`: the HTTP server. Every flag can also come from ``MULTIGUESS_<FLAG>``.

Pods are configured through environment variables (the operator sets them), people through
flags; a flag on the command line wins. Engine and model flags are the ones ``generate`` and
``bench`` share; all flags are declared with ``engine_args.add_flag``, which reports a bad
environment value as a bad flag.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from multiguess.commands.engine_args import (
    add_engine_args,
    add_flag,
    add_switch,
    build_llm,
    configure_threads,
)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_LEVELS = ("debug", "info", "warning", "error")
ANSWER_SECONDS = 5  # after the grace: time for the 503s and error events to reach the clients
MAX_BODY = 4 * 1024 * 1024  # the API's default (multiguess.api.app.MAX_BODY), without importing it
# The HTTP limits' defaults (api.connections.ConnectionLimits, api.gate.BODY_TIMEOUT), likewise.
TIMEOUT_HEADER, TIMEOUT_BODY, TIMEOUT_KEEP_ALIVE, LIMIT_CONCURRENCY = 10.0, 30.0, 5.0, 512


def log_level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}")
    return text.lower()


def served_name(args: argparse.Namespace) -> str:
    if args.model_name:
        return str(args.model_name)
    return Path(args.target.rstrip("/")).name if args.target else "multiguess-default"


def build_engine(args: argparse.Namespace, registry: Any = None) -> Any:
    """Load the models and build the drafter inside the guard (runs on the engine's worker thread).

    With ``--draft-url`` no draft is loaded here: a remote drafter asks the draft server
    (``multiguess serve-draft``), bounding each step by ``--draft-step-timeout`` itself; its
    metrics go to ``registry``, the server's own. The draft server decides how it drafts: a
    draft model, or an EAGLE-3 head whose features the target then captures and sends.
    """
    from multiguess.drafting import Serving
    from multiguess.remote.handshake import load_secret

    secret = load_secret(args.draft_secret, args.draft_secret_file) if args.draft_url else None
    serving = Serving(args.draft_step_timeout, args.draft_cooldown, args.draft_url, secret, registry)
    return build_llm(args, serving).engine


def api_keys(args: argparse.Namespace) -> dict[str, str]:
    """Key -> tenant: ``--api-key`` (tenant ``default``) or the key file ``--api-key-file``
    (``api/keys.py``: one key and its tenant per line; a file holding one bare key is that
    key, tenant ``default``); none: the API is open."""
    from multiguess.api.keys import DEFAULT_TENANT, load_keys, readable_by_others

    if args.api_key and args.api_key_file:
        raise SystemExit("multiguess serve: give --api-key or --api-key-file, not both")
    if not args.api_key_file:
        return {args.api_key: DEFAULT_TENANT} if args.api_key else {}
    try:
        keys = load_keys(args.api_key_file)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise SystemExit(f"multiguess serve: --api-key-file: {exc}") from None
    if readable_by_others(args.api_key_file):
        logging.getLogger(__name__).warning(
            "the API key file %s is readable by every user; chmod o-r it", args.api_key_file
        )
    return keys


def make_server(args: argparse.Namespace) -> Any:
    import uvicorn

    from multiguess.api import ServerSettings, create_app
    from multiguess.api.connections import ConnectionLimits, server_config

    settings = ServerSettings(
        served_name(args),
        args.max_queue,
        args.request_timeout,
        max_body=args.max_body_size,
        api_keys=api_keys(args),
        body_timeout=args.timeout_body,
        protect_metrics=args.protect_metrics,
    )
    app = create_app(lambda: build_engine(args, app.state.metrics.registry), settings)

    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT: readiness fails and new requests get 503 at once, while the port
        stays open (a new connection is answered 503, not refused); in-flight requests finish
        within ``--shutdown-grace``, and those still running then end with a 503 in the API's
        error shape (streams: an error event). Then uvicorn stops and the process exits 0."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            scheduler = getattr(app.state, "scheduler", None)
            if scheduler is None or scheduler.state == "draining":  # not started, or a second signal
                super().handle_exit(sig, frame)
                return
            scheduler.drain()
            threading.Thread(
                target=self.drain, args=(scheduler,), name="multiguess-drain", daemon=True
            ).start()

        def drain(self, scheduler: Any) -> None:
            deadline = time.monotonic() + args.shutdown_grace
            while not scheduler.idle and time.monotonic() < deadline:
                time.sleep(0.05)
            if not scheduler.idle:
                scheduler.expire(
                    f"the server shut down before the request finished ({args.shutdown_grace:g} s grace)"
                )
                answered = time.monotonic() + ANSWER_SECONDS
                while not scheduler.idle and time.monotonic() < answered:
                    time.sleep(0.05)
            self.should_exit = True

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGTERM, signal.SIGINT)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    limits = ConnectionLimits(args.timeout_header, args.timeout_keep_alive, args.limit_concurrency)
    config = server_config(
        app,
        limits,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=ANSWER_SECONDS,  # the drain above already waited the grace
    )
    return DrainingServer(config)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    configure_threads(args.threads)  # before any torch work, on the main thread
    make_server(args).run()
    return 0


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be >= 1")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be > 0, got {text}")
    return value


def add_draft_secret_flags(parser: argparse.ArgumentParser) -> None:
    """The draft protocol's shared secret, on both ends (the operator mounts one per deployment)."""
    add_flag(parser, "--draft-secret", None, str, help="shared secret of the draft protocol (both ends)")
    add_flag(
        parser, "--draft-secret-file", None, str, help="file holding the draft secret (a mounted Secret)"
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions, /generate, /health/*, /metrics. "
        "Without --target: the embedded default pair.",
    )
    add_engine_args(parser)
    add_flag(
        parser,
        "--draft-url",
        None,
        str,
        help="draft server (multiguess serve-draft) instead of a local draft",
    )
    add_draft_secret_flags(parser)
    add_flag(parser, "--api-key", None, str, help="clients must send 'Authorization: Bearer <key>'")
    add_flag(
        parser,
        "--api-key-file",
        None,
        str,
        help="file of API keys, one 'KEY [TENANT]' a line (# comments); the prefix cache is per tenant",
    )
    add_switch(parser, "--protect-metrics", "/metrics needs the API key too (health checks stay open)")
    add_flag(
        parser, "--max-body-size", MAX_BODY, positive_int, help="bytes one request body may have (413 beyond)"
    )
    add_flag(
        parser,
        "--timeout-header",
        TIMEOUT_HEADER,
        positive_float,
        help="seconds a request head may take, from connect or the last response (408 beyond)",
    )
    add_flag(
        parser,
        "--timeout-body",
        TIMEOUT_BODY,
        positive_float,
        help="seconds a request body may take (408 beyond)",
    )
    add_flag(
        parser,
        "--timeout-keep-alive",
        TIMEOUT_KEEP_ALIVE,
        positive_float,
        help="seconds an idle connection stays open",
    )
    add_flag(
        parser,
        "--limit-concurrency",
        LIMIT_CONCURRENCY,
        positive_int,
        help="connections open at once; a request on one more gets 503",
    )
    add_flag(parser, "--host", "0.0.0.0", str, help="address to listen on")
    add_flag(parser, "--port", 8000, int, help="port to listen on")
    add_flag(parser, "--max-queue", 64, int, help="waiting samples beyond the batch before 429")
    add_flag(
        parser, "--request-timeout", 600.0, positive_float, help="seconds per request, queue + generation"
    )
    add_flag(
        parser, "--shutdown-grace", 30.0, positive_float, help="seconds in-flight requests get after SIGTERM"
    )
    add_flag(parser, "--draft-step-timeout", 2.0, positive_float, help="seconds one draft step may take")
    add_flag(parser, "--draft-cooldown", 30.0, float, help="seconds speculation pauses after a draft failure")
    add_flag(parser, "--model-name", None, str, help="served model name (default: the target folder's name)")
    add_flag(parser, "--log-level", "info", log_level, help="debug, info, warning or error")
    parser.set_defaults(func=run)
