"""Forward cost of the quantized path against bf16 on the embedded target, and plain decoding.

Loads the embedded SmolLM2-135M as its Q4_1 GGUF (linears on the integer kernels) and as its
bf16 conversion (the bf16 kernels), caches a 256-token prefix in each, then times forwards of
1, 4, 8, 16 and 32 tokens (a chain after the prefix), the two models interleaved, medians over the
repeats; then plain greedy decoding of a few chat prompts, alternating, in tokens/s. Prints
one JSON object (``--out`` also writes it).

    PYTHONPATH=server python bench/quant_forward.py --repeats 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from multiguess import LLM, SamplingParams
from multiguess.engine.runner import NativeRunner
from multiguess.engine.tree import TokenTree
from multiguess.models.embedded import locate_target_gguf, prepare_target
from multiguess.models.loading import load_model

WIDTHS = (1, 4, 8, 16, 32)
PROMPTS = [
    "Explain how a hash map handles collisions.",
    "Write a short poem about the sea at night.",
    "What are the main causes of inflation?",
    "Give three tips for learning a new language.",
]


def forward_ms(models: dict[str, str], repeats: int) -> dict[str, dict[int, float]]:
    """Median milliseconds of a forward of each width after a 256-token prefix, per model."""
    runners = {}
    for name, path in models.items():
        runner = NativeRunner(load_model(path, device="cpu"), 1, 512)
        runner.forward_trees([0], [0], [TokenTree.chain(list(range(100, 356)))])
        runners[name] = runner
    times: dict[str, dict[int, list[float]]] = {name: {w: [] for w in WIDTHS} for name in models}
    for _ in range(repeats):
        for name, runner in runners.items():
            for width in WIDTHS:
                tree = TokenTree.chain(list(range(400, 400 + width)))
                start = time.perf_counter()
                runner.forward_trees([0], [256], [tree])
                times[name][width].append(time.perf_counter() - start)
    return {name: {w: 1000 * statistics.median(t) for w, t in by.items()} for name, by in times.items()}


def plain_tokens_per_s(models: dict[str, str], rounds: int, tokens: int) -> dict[str, float]:
    """Plain greedy decoding of PROMPTS, tokens/s, the models alternating round by round."""
    llms = {name: LLM(path, None, max_batch=1) for name, path in models.items()}
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    spent = dict.fromkeys(models, 0.0)
    produced = dict.fromkeys(models, 0)
    for llm in llms.values():
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8))  # warm
    for _ in range(rounds):
        for name, llm in llms.items():
            for prompt in PROMPTS:
                start = time.perf_counter()
                out = llm.generate([prompt], params)[0].outputs[0].token_ids
                spent[name] += time.perf_counter() - start
                produced[name] += len(out)
    return {name: produced[name] / spent[name] for name in models}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    models = {"q4_1": str(locate_target_gguf()), "bf16": str(prepare_target())}
    forward = forward_ms(models, args.repeats)
    result = {
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "forward_ms": forward,
        "ratio_to_1": {name: {w: by[w] / by[1] for w in WIDTHS[1:]} for name, by in forward.items()},
        "plain_tokens_per_s": plain_tokens_per_s(models, args.rounds, args.tokens),
    }
    result["plain_q4_1_over_bf16"] = (
        result["plain_tokens_per_s"]["q4_1"] / result["plain_tokens_per_s"]["bf16"]
    )
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
