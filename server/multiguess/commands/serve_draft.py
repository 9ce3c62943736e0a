"""`multiguess serve-draft`: the draft server of ``placement: separate`` (port 8001 by default).

Target servers started with ``--draft-url http://host:8001`` draft through it. It serves a
draft model or (``--drafter eagle3``) an EAGLE-3 head, which reads of its target (``--target``)
only the config, the tokenizer and the token embeddings. Every flag can also come from
``MULTIGUESS_<FLAG>`` (the operator sets MULTIGUESS_DRAFT, _DRAFTER, _TARGET, _QUANTIZATION, _PORT).
"""

from __future__ import annotations

import argparse
import logging
import signal
from typing import Any

from multiguess.commands.engine_args import add_flag, add_switch
from multiguess.commands.serve import (
    LOG_FORMAT,
    add_draft_secret_flags,
    log_level,
    positive_float,
    positive_int,
)
from multiguess.options import DRAFT_MAX_FRAME_BYTES, DRAFT_SERVER_DRAFTERS


def load_draft(args: argparse.Namespace) -> Any:
    """The hosted draft model or EAGLE-3 head (``drafting.host_drafter``); without ``--draft``,
    the embedded pair's (as ``serve`` would use it)."""
    from multiguess.drafting import DraftOptions, host_drafter

    if args.drafter == "eagle3" and args.target is not None and args.draft is None:
        raise SystemExit("serve-draft --drafter eagle3 --target needs --draft (the head's folder)")
    options = DraftOptions(args.draft, args.dtype, args.device, args.draft_quantization, target=args.target)
    return host_drafter(args.drafter, options)


def make_server(args: argparse.Namespace) -> Any:
    import uvicorn

    from multiguess.remote.handshake import load_secret
    from multiguess.remote.server import DraftServerSettings, create_draft_app

    settings = DraftServerSettings(
        args.max_sessions,
        args.session_idle_timeout,
        args.max_model_len,
        args.max_tree_nodes,
        args.eager,
        secret=load_secret(args.draft_secret, args.draft_secret_file),
        max_client_sessions=args.max_client_sessions,
        max_frame_bytes=args.max_frame_bytes,
    )
    app = create_draft_app(lambda: load_draft(args), settings)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        ws="websockets-sansio",
        ws_max_size=args.max_frame_bytes,
    )
    return uvicorn.Server(config)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    # uvicorn stops gracefully on SIGTERM, then re-raises it to the handler it found: make that
    # a no-op, so a pod's normal stop exits 0 rather than "killed by signal".
    signal.signal(signal.SIGTERM, lambda *_: None)
    make_server(args).run()
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve-draft",
        help="serve a draft model to remote target servers (serve --draft-url)",
        description="Draft trees for target servers over a WebSocket (/v1/draft); /health/*, /metrics. "
        "Without --draft: the embedded pair's draft.",
    )
    add_flag(
        parser,
        "--drafter",
        "model",
        str,
        choices=DRAFT_SERVER_DRAFTERS,
        help="a draft model or an EAGLE-3 head",
    )
    add_flag(
        parser, "--draft", None, str, help="draft model folder or hub id; with eagle3, the head's folder"
    )
    add_flag(
        parser,
        "--target",
        None,
        str,
        help="eagle3: the target whose features the head reads (config, tokenizer, token embeddings only)",
    )
    add_flag(
        parser,
        "--draft-quantization",
        None,
        str,
        help="the draft's weights: auto, none or a block format (q8_0, q4_0, q4_1, q4_k, q6_k; CPUs)",
    )
    add_flag(parser, "--dtype", "auto", str, help="auto, bfloat16, float16 or float32")
    add_flag(parser, "--device", "auto", str, help="auto, cpu or cuda[:N]")
    add_flag(parser, "--host", "0.0.0.0", str, help="address to listen on")
    add_flag(parser, "--port", 8001, int, help="port to listen on")
    add_flag(
        parser, "--max-sessions", 16, positive_int, help="sequences (of all clients) with a draft cache slot"
    )
    add_flag(
        parser,
        "--session-idle-timeout",
        300.0,
        positive_float,
        help="seconds before an idle session is evicted",
    )
    add_flag(
        parser,
        "--max-client-sessions",
        8,
        positive_int,
        help="sessions one target connection may hold (its --max-batch); past it, its own are evicted",
    )
    add_draft_secret_flags(parser)
    add_flag(parser, "--max-model-len", 2048, positive_int, help="longest sequence a session may hold")
    add_flag(
        parser,
        "--max-frame-bytes",
        DRAFT_MAX_FRAME_BYTES,
        positive_int,
        help="largest step message accepted (an EAGLE-3 prompt's features travel in one)",
    )
    add_flag(
        parser, "--max-tree-nodes", 64, positive_int, help="largest tree: max(max_nodes, candidates x depth)"
    )
    add_flag(parser, "--log-level", "info", log_level, help="debug, info, warning or error")
    add_switch(parser, "--eager", "plain PyTorch kernels, no prepacked CPU weights (escape hatch)")
    parser.set_defaults(func=run)
