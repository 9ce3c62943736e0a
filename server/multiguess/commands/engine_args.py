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

from multiguess.engine.memory_plan import DEFAULT_GPU_MEMORY_UTILIZATION, check_utilization
from multiguess.options import DRAFTERS, DTYPE_NAMES, QUANTIZATIONS


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
    add_flag(
        parser, "--target", None, help="target model folder, hub id or GGUF file (default: embedded pair)"
    )
    add_flag(parser, "--draft", None, help="draft model folder or hub id (default: embedded draft)")
    add_flag(
        parser,
        "--quantization",
        "none",
        choices=QUANTIZATIONS,
        help="the target's linears in GGUF blocks (q8_0, q4_0, q4_1, q4_k, q6_k; CPUs), or int8 dynamic; a .gguf --target is quantized already",
    )
    add_flag(
        parser,
        "--draft-quantization",
        None,
        choices=QUANTIZATIONS,
        help="int8: dynamic int8 draft; q8_0, q4_0, q4_1, q4_k, q6_k: GGUF blocks",
    )
    add_flag(
        parser,
        "--drafter",
        "model",
        choices=DRAFTERS,
        help="draft model, EAGLE-3 head on the target's features (--draft: its folder), n-gram lookup, "
        "suffix (copy drafts from the request and recent outputs alone), or none",
    )
    add_flag(parser, "--dtype", "auto", choices=DTYPE_NAMES, help="weights/activations dtype")
    add_flag(
        parser,
        "--draft-dtype",
        None,
        choices=DTYPE_NAMES,
        help="the draft's dtype (default: --dtype's setting)",
    )
    add_flag(parser, "--device", "auto", help="target device (auto, cpu, cuda, cuda:1)")
    add_flag(parser, "--draft-device", None, help="draft device (default: the target's)")
    add_flag(parser, "--num-candidates", 3, int, help="children per expanded node (1 = chain)")
    add_flag(parser, "--depth", 4, int, help="levels drafted per step")
    add_flag(parser, "--max-nodes", 16, int, help="drafted nodes per tree at most")
    add_flag(parser, "--max-batch", 8, int, help="sequences decoded together at most")
    add_flag(
        parser,
        "--max-model-len",
        None,
        int,
        help="context length (prompt + output); default and upper bound: the target's config",
    )
    add_flag(
        parser,
        "--gpu-memory-utilization",
        DEFAULT_GPU_MEMORY_UTILIZATION,
        utilization,
        help="share of each GPU's memory for weights, activations and KV caches, in (0, 1]",
    )
    add_flag(
        parser,
        "--max-prefill-tokens",
        "auto",
        prefill_tokens,
        help="prompt tokens prefilled per step at most (chunked prefill: a long prompt does not "
        "stall running streams); auto: the largest chunk whose forward takes about 8 decode steps, "
        "measured at startup; 0: each prompt whole",
    )
    add_flag(
        parser,
        "--prompt-lookup",
        32,
        int,
        help="longest copy draft in tokens (what followed the text's suffix where it occurred before, "
        "in the request or recent outputs), grafted onto trees where it pays; 0: none",
    )
    add_flag(parser, "--threads", 0, int, help="CPU threads for torch (0: the cores this process may use)")
    add_switch(parser, "--no-adaptive", "always draft the full tree budget")
    add_switch(parser, "--eager", "plain PyTorch kernels, no prepacked CPU weights (escape hatch)")
    add_switch(parser, "--cuda-graphs", "replay captured decode/verify forwards on GPUs (opt-in)")
    add_switch(parser, "--full-draft-vocab", "the draft scores every token, not only its draft_vocab.json")
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get(env_name("--enable-prefix-caching"), "1").lower() not in ("0", "false", "no"),
        help="start prompts from the KV of a prefix shared with a recent or running request (default "
        "on; the environment turns it off with 0, false or no) [env MULTIGUESS_ENABLE_PREFIX_CACHING]",
    )


def prefill_tokens(text: str) -> int | str:
    """``auto`` or a count of tokens (0: off); argparse reports the ValueError as a bad value."""
    if text == "auto":
        return text
    count = int(text)
    if count < 0:
        raise ValueError(f"--max-prefill-tokens must be auto or >= 0, got {count}")
    return count


def utilization(text: str) -> float:
    """A share in (0, 1]; argparse reports the ValueError as a bad flag value."""
    return check_utilization(float(text))


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


def build_llm(args: argparse.Namespace) -> Any:
    """An ``LLM`` from parsed engine flags."""
    from multiguess.llm import LLM

    configure_threads(args.threads)
    if args.target is not None and args.drafter in ("model", "eagle3") and args.draft is None:
        raise SystemExit(
            "--target needs --draft (a draft model, or an EAGLE-3 head with --drafter eagle3; or --drafter ngram|suffix|none)"
        )
    return LLM(
        target=args.target,
        draft=args.draft,
        num_candidates=args.num_candidates,
        depth=args.depth,
        max_nodes=args.max_nodes,
        dtype=args.dtype,
        device=args.device,
        draft_device=args.draft_device,
        draft_quantization=args.draft_quantization,
        quantization=args.quantization,
        max_batch=args.max_batch,
        max_model_len=args.max_model_len,
        drafter=args.drafter,
        adaptive=not args.no_adaptive,
        eager=args.eager,
        cuda_graphs=args.cuda_graphs,
        draft_dtype=args.draft_dtype,
        draft_vocab=not args.full_draft_vocab,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_prefill_tokens=args.max_prefill_tokens or None,
        prefix_caching=args.enable_prefix_caching,
        prompt_lookup=args.prompt_lookup,
    )
