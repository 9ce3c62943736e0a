"""Grounded workloads under load: ``bench/grounded.py``'s prompts over HTTP from 1, 4 and 8 clients.

``serving_load.py --workload grounded`` runs it: servers with the embedded pair, plain
decoding (``--drafter none``, no prompt lookup, so a prediction drafts nothing), the default
configuration (on the default weights the copy sources alone, ``--drafter auto``), on the
default weights the draft model beside them (``--drafter model``: what it adds, or costs) and a
second server with plain decoding's flags (``control``: what two identical servers differ by in
the same run, the spread every other ratio is read against) take turns workload by workload
(the order rotating every repeat), each client sending the workload's prompts (the code edit
with the original file as its ``prediction``) as greedy chat completions. Every request decodes in a cache scope of its own (``cache_salt``; the agent
loop's requests share one per run, as ``grounded.cache_salts`` says), so no request copies
another's reply from the recent-output index or reuses its prompt's KV. Reported per workload,
level and setup: the median tokens/s over repeats, the median ratio to plain decoding within
each repeat, the mean accepted length (1 + accepted drafts per verification, over every
request), and whether each reply is plain decoding's text.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

from grounded import PREDICTIONS, WORKLOADS, cache_salts
from openai import AsyncOpenAI

# Plain decoding drafts nothing, a request's prediction included (prompt lookup off). Plain and
# default decoding run on the target's weights as served by default (on CPUs its Q4_1 file) and
# in bf16, the draft model on the default weights; each setup is compared with plain decoding
# of the same weights. The control is plain decoding again, in a server of its own: its ratio to
# plain decoding is what two identical servers differ by in the same run, the noise every other
# ratio is read against.
PLAIN = ["--drafter", "none", "--prompt-lookup", "0"]
BF16 = ["--quantization", "none"]
SETUPS = {
    "plain": PLAIN,
    "default": [],
    "model": ["--drafter", "model"],
    "control": PLAIN,
    "plain bf16": [*PLAIN, *BF16],
    "default bf16": BF16,
}


def reference(name: str) -> str:
    """The plain decoding a setup is compared with: the one on the same weights."""
    return "plain bf16" if serves_bf16(SETUPS[name]) else "plain"


async def one_request(
    client: AsyncOpenAI, model: str, prompt: str, predicted: str | None, salt: str, max_tokens: int
) -> dict:
    """One greedy chat completion of ``prompt`` (with ``predicted`` as its prediction): its
    text, tokens and speculation counts."""
    body: dict = {"cache_salt": salt}
    if predicted is not None:
        body["prediction"] = {"type": "content", "content": predicted}
    reply = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body=body,
    )
    stats = (reply.model_extra or {}).get("multiguess") or {}
    assert reply.usage is not None
    return {
        "prompt": prompt,
        "text": reply.choices[0].message.content,
        "tokens": reply.usage.completion_tokens,
        "verify_steps": stats.get("verify_steps", 0),
        "accepted_tokens": stats.get("accepted_tokens", 0),
    }


async def run_workload(
    url: str, workload: str, clients: int, requests: int, run: str, max_tokens: int
) -> dict:
    """``requests`` requests (the workload's prompts in turn, each with its ``cache_salts``
    of ``run``) from ``clients`` clients: every reply and the wall time."""
    prompts, predicted = WORKLOADS[workload], PREDICTIONS.get(workload)
    client = AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    salts = cache_salts(workload, run, requests)
    queue = [(prompts[i % len(prompts)], salts[i]) for i in range(requests)]
    replies: list[dict] = []

    async def worker() -> None:
        while queue:
            prompt, salt = queue.pop()
            replies.append(await one_request(client, model, prompt, predicted, salt, max_tokens))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - start
    await client.close()
    return {"replies": replies, "seconds": wall, "tokens": sum(r["tokens"] for r in replies)}


def measure(servers: dict[str, int], levels: list[int], args: argparse.Namespace) -> dict[str, dict]:
    """Every workload at every level ``args.repeats`` times, the setups taking turns."""
    names = list(servers)
    runs: dict[str, dict[int, dict[str, list[dict]]]] = {
        w: {c: {n: [] for n in names} for c in levels} for w in WORKLOADS
    }
    for c in levels:
        for repeat in range(args.repeats):
            run_name = f"grounded-{c}-{repeat}-{time.time_ns()}"
            order = names[repeat % len(names) :] + names[: repeat % len(names)]
            for workload, texts in WORKLOADS.items():
                for name in order:
                    url = f"http://127.0.0.1:{servers[name]}/v1"
                    requests = max(c * args.rounds, len(texts))
                    run = asyncio.run(run_workload(url, workload, c, requests, run_name, args.max_tokens))
                    runs[workload][c][name].append(run)
                    rate = run["tokens"] / run["seconds"]
                    print(
                        f"  c={c} repeat {repeat + 1} {name} {workload}: {rate:.1f} tokens/s", file=sys.stderr
                    )
    return {w: summarise(by_level) for w, by_level in runs.items()}


def summarise(by_level: dict[int, dict[str, list[dict]]]) -> dict:
    """Per level and setup: median tokens/s, median ratio to plain within a repeat, mean
    accepted length over every request, and identity of every reply to plain decoding's."""
    rows = []
    for c, by_setup in by_level.items():
        for name, runs in by_setup.items():
            plain = by_setup[reference(name)]
            texts = {r["prompt"]: r["text"] for run in plain for r in run["replies"]}
            replies = [r for run in runs for r in run["replies"]]
            steps = sum(r["verify_steps"] for r in replies)
            rows.append(
                {
                    "clients": c,
                    "setup": name,
                    "tokens_per_second": round(
                        statistics.median(r["tokens"] / r["seconds"] for r in runs), 2
                    ),
                    "vs_plain": round(statistics.median(map(ratio, runs, plain)), 3),
                    "mean_accepted_length": round(1 + sum(r["accepted_tokens"] for r in replies) / steps, 2)
                    if steps
                    else None,
                    "identical_to_plain": all(texts[r["prompt"]] == r["text"] for r in replies),
                    "requests": len(replies),
                }
            )
    return {"rows": rows}


def ratio(run: dict, plain: dict) -> float:
    """Throughput of ``run`` over plain decoding's in the same repeat."""
    return run["tokens"] / run["seconds"] / (plain["tokens"] / plain["seconds"])


def run(args: argparse.Namespace, start_servers: object) -> dict:
    """Start the setups' servers (``start_servers`` from serving_load), measure, stop them."""
    levels = [int(c) for c in (args.concurrency or "1,4,8").split(",")]
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    setups = {name: ["--max-batch", str(max(levels)), *flags] for name, flags in SETUPS.items()}
    try:
        start_servers(servers, setups, args)  # type: ignore[operator]
        results = measure({name: port for name, (_, port) in servers.items()}, levels, args)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=60)
    return {"levels": levels, "setups": setups, "workloads": results, "target_weights": served_weights()}


def served_weights() -> dict[str, str]:
    """Each setup's target weights as its server loads them on this machine."""
    from multiguess.benchmark import weights_of
    from multiguess.llm import load_target

    default = weights_of(load_target(None, "auto", "auto")[0].model)
    return {name: "bfloat16" if serves_bf16(flags) else default for name, flags in SETUPS.items()}


def serves_bf16(flags: list[str]) -> bool:
    """Whether a setup's flags load the target in bf16: ``--quantization none`` (plain
    decoding's ``--drafter none`` does not)."""
    return any(flags[i : i + len(BF16)] == BF16 for i in range(len(flags)))
