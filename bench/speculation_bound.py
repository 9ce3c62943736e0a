"""What perfect drafts could reach on this machine: the grounded workloads' bound on × plain.

For each grounded workload (``bench/grounded.py``'s prompts and plain decoding's greedy replies
to them) and each client count of the load benchmark (1, 4 and 8), the ratio of plain
decoding's time to speculation's if every drafted token were accepted and drafting cost
nothing: each sequence's reply in forwards of the widest tree that pays (up to
``1 + prompt_lookup`` rows per sequence), its prompt prefilled in one forward by both.
The times are the target's own, measured here: forwards of every batch and width after the
replies' typical context, each prompt's prefill, and the engine's time per step outside the
forward, timed in plain decoding's steps at each client count. No drafter reaches the bound; it
says which of ``grounded.py``'s and ``serving_load.py --workload grounded``'s ratios this
machine leaves room for. Run from the repo root on an otherwise idle machine:
``.venv/bin/python bench/speculation_bound.py``; the JSON goes to
docs/bench/speculation-bound.json and docs/BENCHMARKS.md is rendered again.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))

import bench_docs
from grounded import MAX_TOKENS, SHARED, WORKLOADS, chat
from multiguess import LLM, SamplingParams
from multiguess.benchmark import weights_of
from multiguess.engine.config import EngineConfig
from multiguess.engine.runner import NativeRunner
from multiguess.engine.suffix import MAX_MATCH
from multiguess.engine.timing import cache_context, time_forward, time_settled
from multiguess.provenance import provenance

CLIENTS = (1, 4, 8)  # the load benchmark's levels (serving_load.py --workload grounded)
# The code edits again with a prediction: it changes the drafts, not the bound.
SAME_PROMPTS = frozenset({"code edit + prediction"})

# Seconds of a target forward of ``batch`` sequences of ``rows`` rows each.
Forward = Callable[[int, int], float]


def decode_seconds(steps: list[int], clients: int, forward: Forward, outside: float) -> float:
    """Seconds ``clients`` sequences in step take to decode in ``steps``, each a forward of that
    many rows a sequence and ``outside`` seconds of the engine's work around it."""
    return sum(forward(clients, rows) + outside for rows in steps)


def perfect_steps(reply: int, clients: int, forward: Forward, widest: int, outside: float) -> list[int]:
    """The cheapest steps of one width (at most ``widest`` rows) that decode ``reply`` tokens
    when every drafted token is accepted: ``ceil(reply / rows)`` steps of ``rows``."""
    shapes = ([rows] * math.ceil(reply / rows) for rows in range(1, widest + 1))
    return min(shapes, key=lambda steps: decode_seconds(steps, clients, forward, outside))


def copied_run(reply: list[int], at: int, sources: list[list[int]], longest: int) -> int:
    """How many of ``reply``'s tokens from ``at`` on a copy drafter would draft right: of the
    places in ``sources`` or in the reply before ``at`` where the longest suffix of
    ``reply[:at]`` occurs (at most ``MAX_MATCH`` tokens), the one whose continuation agrees
    with the reply longest (at most ``longest`` tokens); 0 where the last token occurs nowhere
    with a continuation. It chooses among equal matches by what comes next, which no drafter
    can: copies alone do no better."""
    if at == 0:
        return 0
    best = (0, 0)  # (suffix matched, tokens agreeing after it)
    for text in (*sources, reply[:at]):
        for end in range(len(text) - 1):
            if text[end] != reply[at - 1]:
                continue
            matched = 1
            while matched < min(MAX_MATCH, end + 1, at) and text[end - matched] == reply[at - 1 - matched]:
                matched += 1
            agree = 0
            while (
                agree < longest
                and end + 1 + agree < len(text)
                and at + agree < len(reply)
                and text[end + 1 + agree] == reply[at + agree]
            ):
                agree += 1
            best = max(best, (matched, agree))
    return best[1]


def copy_steps(reply: list[int], sources: list[list[int]], widest: int) -> list[int]:
    """The steps a copy drafter decodes ``reply`` in when it drafts ``copied_run``'s tokens
    each step and nothing else (at most ``widest`` rows a sequence): each step verifies them
    and adds the target's next token."""
    steps, at = [], 0
    while at < len(reply):
        drafted = min(copied_run(reply, at, sources, widest - 1), len(reply) - at - 1)
        steps.append(1 + drafted)
        at += 1 + drafted
    return steps


def bound(
    prompt_seconds: list[float],
    plain: list[list[int]],
    drafted: list[list[int]],
    clients: int,
    forward: Forward,
    outside: float,
) -> float:
    """A workload's bound on × plain at ``clients``: the time of each prompt's prefill and
    plain decoding's steps (``plain``) over that of its prefill and the ``drafted`` steps,
    each summed over the workload's prompts."""

    def seconds(steps: list[list[int]]) -> float:
        return sum(
            clients * prefill + decode_seconds(s, clients, forward, outside)
            for prefill, s in zip(prompt_seconds, steps, strict=True)
        )

    return seconds(plain) / seconds(drafted)


def measure_forwards(runner: NativeRunner, context: int, widest: int, rounds: int) -> dict[int, list[float]]:
    """The fastest of ``rounds`` forwards of each batch of ``CLIENTS`` and each width up to
    ``widest`` rows a sequence, after ``context`` cached tokens: by batch, index rows - 1."""
    context = cache_context(runner, context, max(CLIENTS) * widest)
    best = {b: [math.inf] * widest for b in CLIENTS}
    for _ in range(rounds):
        for b in CLIENTS:
            for rows in range(1, widest + 1):
                best[b][rows - 1] = min(best[b][rows - 1], time_settled(runner, context, rows, b))
    return best


def prefill_seconds(runner: NativeRunner, length: int, rounds: int) -> float:
    """The fastest of ``rounds`` prefills of a ``length``-token prompt in one forward."""
    return min(time_forward(runner, 0, length, last_only=True) for _ in range(rounds))


def step_outside(llm: LLM, prompt: list[int], clients: int) -> float:
    """The median time of a plain decoding step of ``clients`` sequences of ``prompt`` outside
    the target's forward, timed while all of them decode (none prefilling, none finished): the
    step's time less that of the runner's forward within it (its ``forward_trees``, timed on
    this runner alone while the steps run)."""
    engine, runner = llm.engine, llm.engine.target
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for i in range(clients):
        engine.add_request(f"step-{clients}-{i}", prompt, replace(params, cache_salt=f"step-{clients}-{i}"))
    forward_trees, in_forward = runner.forward_trees, [0.0]

    def timed(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return forward_trees(*args, **kwargs)
        finally:
            in_forward[0] += time.perf_counter() - start

    runner.forward_trees = timed
    outside = []
    try:
        while engine.has_unfinished():
            decoding = [s for s in engine.running if not s.prefilling and not s.finished]
            steady = not engine.waiting and len(decoding) == clients and all(s.output_ids for s in decoding)
            in_forward[0], start = 0.0, time.perf_counter()
            finished = any(out.finished for out in engine.step())
            if steady and not finished:
                outside.append(time.perf_counter() - start - in_forward[0])
    finally:
        del runner.forward_trees  # the class's method again
    return statistics.median(outside)


def weights_rows(quantization: str, rounds: int, widest: int | None) -> tuple[dict, list[dict]]:
    """One weights' measurements and each workload's bound at every client count."""
    llm = LLM(max_batch=max(CLIENTS), drafter="none", prompt_lookup=0, quantization=quantization)
    widest = widest or 1 + EngineConfig().prompt_lookup  # the default's longest copy draft
    runner = llm.engine.target
    llm.generate(chat(llm, "Say hello."), SamplingParams(max_tokens=8, temperature=0))
    prompts = {w: [chat(llm, p) for p in ps] for w, ps in WORKLOADS.items() if w not in SAME_PROMPTS}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    replies = {w: [r.outputs[0].token_ids for r in llm.generate(ps, params)] for w, ps in prompts.items()}
    contexts = [len(p) + len(r) // 2 for w in prompts for p, r in zip(prompts[w], replies[w], strict=True)]
    context = round(statistics.median(contexts))
    forwards = measure_forwards(runner, context, widest, rounds)
    prefills = {
        n: prefill_seconds(runner, n, rounds) for n in {len(p) for ps in prompts.values() for p in ps}
    }
    outside = {b: step_outside(llm, prompts["open chat"][0], b) for b in CLIENTS}

    def forward(batch: int, rows: int) -> float:
        return forwards[batch][rows - 1]

    weights = weights_of(runner.model)
    rows = []
    for workload, ps in prompts.items():
        seconds = [prefills[len(p)] for p in ps]
        plain = [[1] * len(r) for r in replies[workload]]
        # The agent loop's requests share a cache scope: each may copy the earlier replies.
        shared = workload in SHARED
        copied = [
            copy_steps(r, [p, *(replies[workload][:i] if shared else [])], widest)
            for i, (p, r) in enumerate(zip(ps, replies[workload], strict=True))
        ]
        for clients in CLIENTS:
            perfect = [
                perfect_steps(len(r), clients, forward, widest, outside[clients]) for r in replies[workload]
            ]
            rows.append(
                {
                    "workload": workload,
                    "weights": weights,
                    "clients": clients,
                    "prompt_tokens": round(statistics.mean(len(p) for p in ps), 1),
                    "reply_tokens": round(statistics.mean(len(r) for r in replies[workload]), 1),
                    "bound": round(bound(seconds, plain, perfect, clients, forward, outside[clients]), 3),
                    "copies_bound": round(
                        bound(seconds, plain, copied, clients, forward, outside[clients]), 3
                    ),
                }
            )
    measured = {
        "weights": weights,
        "context": context,
        "widest": widest,
        "outside_forward_ms": {str(b): round(outside[b] * 1e3, 3) for b in CLIENTS},
        "forward_ms": {str(b): [round(s * 1e3, 3) for s in forwards[b]] for b in CLIENTS},
    }
    return measured, rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="each forward's fastest of this many")
    parser.add_argument(
        "--quantization",
        default="auto,none",
        help="the target's weights: auto (LLM()'s default: the Q4_1 file on CPUs), none (bf16)",
    )
    parser.add_argument(
        "--widest", type=int, default=None, help="rows a sequence (default: 1 + prompt lookup)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("docs"), help="docs folder: bench/ JSON and BENCHMARKS.md"
    )
    args = parser.parse_args()
    measured, rows = [], []
    for quantization in args.quantization.split(","):
        print(f"measuring {quantization} weights", flush=True)
        m, r = weights_rows(quantization, args.rounds, args.widest)
        measured.append(m)
        rows += r
        for row in r:
            print(row["workload"], row["weights"], row["clients"], row["bound"], flush=True)
    report = {
        **provenance(),
        "max_tokens": MAX_TOKENS,
        "clients": list(CLIENTS),
        "measured": measured,
        "rows": rows,
    }
    path = args.out / "bench" / bench_docs.SPECULATION_BOUND_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    bench_docs.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
