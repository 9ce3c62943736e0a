"""Engine and model flags shared by the commands that build an engine (generate, serve, bench).

Every flag can also come from the environment as ``MULTIGUESS_<FLAG>`` (``--num-candidates`` is
``MULTIGUESS_NUM_CANDIDATES``), which is how the operator configures pods; a flag given on the
command line wins.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable
from typing import Any

from multiguess.drafting import DRAFTERS, READS_DRAFT
from multiguess.engine.config import EngineConfig, ModelConfig
from multiguess.flags import Flag, flags


def env_name(flag: str) -> str:
    return "MULTIGUESS_" + flag.lstrip("-").replace("-", "_").upper()


def add_flag(
    parser: argparse.ArgumentParser, flag: str, default: Any, kind: Callable[[str], Any] = str, **kw: Any
) -> None:
    """A flag whose default comes from ``MULTIGUESS_<FLAG>`` when that is set. argparse converts
    a string default with ``type`` as if typed, so a bad environment value fails like a bad flag."""
    raw = os.environ.get(env_name(flag))
    help_text = kw.pop("help", "")
    parser.add_argument(
        flag,
        default=default if raw in (None, "") else raw,
        type=kind,
        help=f"{help_text} [env {env_name(flag)}]",
        **kw,
    )


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """A flag for every flagged field of ``ModelConfig`` and ``EngineConfig`` (``engine/config.py``
    holds their defaults and help), then ``--threads``."""
    for record in (ModelConfig, EngineConfig):
        for field, flag in flags(record):
            add_field_flag(parser, flag, field.default)
    add_flag(parser, "--threads", 0, int, help="CPU threads for torch (0: the cores this process may use)")


def add_field_flag(parser: argparse.ArgumentParser, flag: Flag, default: Any) -> None:
    """One field's flag, in the form its ``Flag`` names (``flags.Flag``)."""
    assert flag.name is not None
    if flag.form == "value":
        add_flag(parser, flag.name, default, flag.parse, choices=flag.choices, help=flag.help)
    elif flag.form == "toggle":
        raw = os.environ.get(env_name(flag.name))
        parser.add_argument(
            flag.name,
            action=argparse.BooleanOptionalAction,
            default=default if raw is None else raw.lower() not in ("0", "false", "no"),
            help=f"{flag.help} [env {env_name(flag.name)}]",
        )
    else:
        add_switch(parser, flag.name, flag.help)


def given(record: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values of ``record``'s flagged fields in parsed engine flags, by field name."""
    return {field.name: flag.value(args) for field, flag in flags(record)}


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The ``EngineConfig`` that parsed engine flags name; ``overrides`` replace fields."""
    return EngineConfig(**{**given(EngineConfig, args), **overrides})


def add_switch(parser: argparse.ArgumentParser, flag: str, help_text: str) -> None:
    """An on/off flag; the environment turns it on with 1, true or yes."""
    default = os.environ.get(env_name(flag), "").lower() in ("1", "true", "yes")
    parser.add_argument(
        flag, action="store_true", default=default, help=f"{help_text} [env {env_name(flag)}]"
    )


def configure_threads(threads: int) -> int:
    """Intra-op threads = usable cores (or ``threads``); one inter-op thread, since the engine
    runs one forward at a time. Set before the first torch op, as torch requires."""
    import torch

    count = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(count)
    with contextlib.suppress(RuntimeError):  # inter-op threads can be set once per process
        torch.set_num_interop_threads(1)
    return count


def build_llm(args: argparse.Namespace, serving: Any = None) -> Any:
    """An ``LLM`` from parsed engine flags; ``serving``: a server's (``drafting.Serving``)."""
    from multiguess.llm import LLM

    configure_threads(args.threads)
    remote = serving is not None and serving.url
    if args.target is not None and args.drafter in READS_DRAFT and args.draft is None and not remote:
        others = "|".join(d for d in DRAFTERS if d not in READS_DRAFT)
        raise SystemExit(
            f"--target needs --draft (a draft model, or an EAGLE-3 head with --drafter eagle3; or --drafter {others})"
        )
    return LLM(**given(ModelConfig, args), **given(EngineConfig, args), serving=serving)
