"""``multiguess generate``: one prompt through the engine; prints the text and the stats."""

from __future__ import annotations

import argparse
import json
import sys
import time

from multiguess.commands.engine_args import add_engine_args, build_llm


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate text for one prompt")
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    add_engine_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from multiguess.errors import MultiguessError
    from multiguess.params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
        llm = build_llm(args)
        prompt = args.prompt
        if args.chat:
            prompt = llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
        start = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        elapsed = time.perf_counter() - start
    except (MultiguessError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out.text)
    stats = dict(out.stats, tokens=len(out.token_ids), seconds=round(elapsed, 3))
    stats["tokens_per_second"] = round(len(out.token_ids) / elapsed, 2) if elapsed else 0.0
    print(json.dumps(stats), file=sys.stderr)
    return 0
