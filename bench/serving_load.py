"""Load benchmark over HTTP: throughput and latency against concurrency, several server setups.

Starts real ``multiguess serve`` processes on 127.0.0.1 with the embedded pair, all setups at
once (an idle server uses no CPU), and drives them with an async streaming client (the ``openai``
package) at several concurrency levels. Two workloads:

``--workload mixed`` (the default): one user message per request, each request in a cache scope
of its own (the prompts come round again), three setups,

    (a) batched + adaptive speculation  (--max-batch 16)
    (b) batched, no speculation         (--max-batch 16 --drafter none --prompt-lookup 0)
    (c) unbatched speculation           (--max-batch 1)
    (d) (b) again, in a server of its own: the control, whose ratio to (b) is what two
        identical servers differ by in the same run, the noise (a)'s ratios are read against

``--workload shared-prompt``: every request opens with the same system prompt of several
hundred tokens and its own user message, and four setups, batched and speculating, measure
prefix reuse and chunked prefill apart and together (time to first token and the gaps between
streamed chunks, medians and p90):

    (a) prefix caching + chunked prefill  (--max-prefill-tokens N)
    (b) prefix caching, whole prefills    (--max-prefill-tokens 0)
    (c) no prefix caching, chunked prefill (--no-enable-prefix-caching --max-prefill-tokens N)
    (d) no prefix caching, whole prefills

``--workload grounded``: ``bench/grounded.py``'s workloads (code edits with and without the
original file as the prediction, extraction, reformatting, QA over passages, an agent loop, open
chat) at 1, 4 and 8 clients, plain decoding against the default configuration
(``grounded_load.py``).

``--workload long-prompt``: one greedy stream runs while a request with a prompt of
``--long-tokens`` token ids (2,000; new ids each trial, so no prefix cache helps; the stream
in a cache scope of its own each trial, so it copies no earlier trial's) arrives; the
stream's longest pause between text chunks while that prompt is prefilled, its median gap then
and before, and the long request's latency, in two setups taking turns:

    (a) chunked prefill, the default (the chunk the server measured, read from /metrics)
    (b) whole prefills                (--max-prefill-tokens 0)

Machines are noisy (±5% between runs here), so each level is run ``--repeats`` times, the setups
taking turns in a rotating order, and throughput is the median over repeats; latencies pool
every request of a level. Reports generated tokens/s, requests/s, p50/p95 end-to-end latency and
time to first token, (a) relative to (b) and (c), and writes JSON and a plot under docs/, from
which docs/BENCHMARKS.md is rendered again (``bench/bench_docs.py``).
Run: ``.venv/bin/python bench/serving_load.py [--workload shared-prompt|long-prompt]``; ``--serve-args``
passes flags to every server (another model pair, a dtype) and ``--out`` writes elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from local_server import free_port, start_ready
from openai import AsyncOpenAI

BATCHED_PLAIN = ["--max-batch", "16", "--drafter", "none", "--prompt-lookup", "0"]
SETUPS = {
    "a: batched + adaptive speculation": ["--max-batch", "16"],
    "b: batched, no speculation": BATCHED_PLAIN,
    "c: unbatched speculation": ["--max-batch", "1"],
    "d: batched, no speculation, a second server": BATCHED_PLAIN,
}
NO_PREFIX = ["--no-enable-prefix-caching"]
WHOLE = ["--max-prefill-tokens", "0"]
LONG_SETUPS = {"a: chunked prefill (default)": [], "b: whole prefills": WHOLE}
STREAM_PROMPT = "Write a long story about a lighthouse keeper and the ships she watches."
# Tokens the stream may write: enough to outlast the long prompt's prefill on any machine (it is
# closed half a second after the long request returns), within the embedded target's 2,048.
STREAM_TOKENS = 1500


def shared_setups(chunk: int) -> dict[str, list[str]]:
    chunked = ["--max-prefill-tokens", str(chunk)]
    return {
        f"a: prefix caching + chunked prefill ({chunk})": ["--max-batch", "16", *chunked],
        "b: prefix caching, whole prefills": ["--max-batch", "16", *WHOLE],
        f"c: no prefix caching, chunked prefill ({chunk})": ["--max-batch", "16", *NO_PREFIX, *chunked],
        "d: no prefix caching, whole prefills": ["--max-batch", "16", *NO_PREFIX, *WHOLE],
    }


# The shared system prompt: a support assistant's standing instructions, several hundred tokens.
SYSTEM_PROMPT = " ".join(
    [
        "You are the support assistant of a company that runs a language-model serving platform.",
        "Answer the user's question directly and briefly, in plain English, without greetings.",
        "When the question is about configuration, name the exact setting and its default value;",
        "when it is about an error, first say what the error means, then the most likely cause,",
        "then one concrete fix the user can try. Never invent settings, commands or numbers that",
        "you are not sure about: say that you do not know and suggest where to look instead.",
        "Prefer short paragraphs to lists, and lists to tables. Quote commands in backticks.",
        "The platform serves models over an OpenAI-compatible HTTP API with streaming, runs on",
        "Kubernetes with an operator that scales replicas on queue latency, and supports",
        "speculative decoding with a small draft model that proposes tokens the large model",
        "verifies, which makes generation faster without changing its output. Users deploy on",
        "GPUs and sometimes on CPUs; memory, context length and batch size are the settings they",
        "ask about most, followed by authentication, timeouts, logging and metrics. Requests that",
        "wait too long are rejected with status 429 and a Retry-After header; requests that are",
        "malformed get a 400 that names the field. Health checks live under /health, metrics",
        "under /metrics in the Prometheus format. If the user asks for code, give a minimal,",
        "complete example in Python using the openai package, and explain each line that is not",
        "obvious. If the user writes in another language, answer in that language. If a question",
        "is outside the platform's scope, say so in one sentence and stop. Keep every answer",
        "under one hundred and fifty words unless the user asks for more detail, and end with",
        "nothing but the answer itself: no summary, no offer of further help, no sign-off.",
    ]
)


def start_servers(
    servers: dict[str, tuple[subprocess.Popen, int]], setups: dict[str, list[str]], args: argparse.Namespace
) -> None:
    """One server per setup, each on a free port, recorded in ``servers`` as it starts (so the
    caller stops those already started if a later one fails)."""
    for name, flags in setups.items():
        port = free_port()
        print(f"starting {name} ...", file=sys.stderr)
        servers[name] = (start_server([*flags, *args.serve_args.split()], port, args.threads), port)


def start_server(extra: list[str], port: int, threads: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [
        sys.executable,
        "-m",
        "multiguess.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]
    return start_ready(cmd, env, port, timeout=600)


def messages_for(prompt: str, system: str | None) -> list[dict[str, str]]:
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": prompt}]


async def one_request(
    client: AsyncOpenAI, model: str, messages: list[dict[str, str]], max_tokens: int, salt: str | None
) -> dict:
    """One streamed chat request: time to the first text, end to end, tokens, prompt tokens, and
    the gaps between the chunks that carried text after the first (what a reader sees stall).
    With ``salt`` it decodes in that cache scope (``cache_salt``)."""
    start = time.perf_counter()
    first = last = None
    tokens = prompt_tokens = 0
    gaps = []
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"cache_salt": salt} if salt else None,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            if first is None:
                first = now - start
            else:
                gaps.append(now - last)
            last = now
        if chunk.usage is not None:
            tokens, prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
    total = time.perf_counter() - start
    ttft = first if first is not None else total
    return {"ttft": ttft, "e2e": total, "tokens": tokens, "prompt_tokens": prompt_tokens, "gaps": gaps}


async def served_model(client: AsyncOpenAI) -> str:
    return (await client.models.list()).data[0].id


async def run_level(
    base_url: str,
    conversations: list[list[dict[str, str]]],
    concurrency: int,
    requests: int,
    max_tokens: int,
    own_scopes: bool,
) -> tuple[list[dict], float]:
    """Every request's timings and the wall time of ``requests`` requests from ``concurrency``
    clients; with ``own_scopes`` each request in a cache scope of its own, so a prompt that comes
    round again neither reuses the KV of its earlier run nor copies its reply."""
    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    model = await served_model(client)
    queue = [conversations[i % len(conversations)] for i in range(requests)]
    results: list[dict] = []

    async def worker() -> None:
        while queue:
            salt = uuid.uuid4().hex if own_scopes else None
            results.append(await one_request(client, model, queue.pop(), max_tokens, salt))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    return results, wall


def percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4) if ordered else None


def summarise(concurrency: int, runs: list[tuple[list[dict], float]]) -> dict:
    """Median throughput over repeated runs; latency percentiles over all their requests, and
    over every gap between streamed chunks (inter-token latency as a reader sees it)."""
    results = [r for run, _ in runs for r in run]
    gaps = [g for r in results for g in r["gaps"]]

    def pct(key: str, q: float) -> float:
        return percentile([r[key] for r in results], q)  # type: ignore[return-value]

    tokens = [sum(r["tokens"] for r in run) / wall for run, wall in runs]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "repeats": len(runs),
        "tokens_per_second": round(statistics.median(tokens), 2),
        "tokens_per_second_runs": [round(t, 2) for t in tokens],
        "requests_per_second": round(statistics.median(len(run) / wall for run, wall in runs), 3),
        "e2e_p50": round(statistics.median(r["e2e"] for r in results), 3),
        "e2e_p95": pct("e2e", 0.95),
        "ttft_p50": round(statistics.median(r["ttft"] for r in results), 3),
        "ttft_p90": pct("ttft", 0.90),
        "ttft_p95": pct("ttft", 0.95),
        "itl_p50": round(statistics.median(gaps), 4) if gaps else None,
        "itl_p90": percentile(gaps, 0.90),
        "itl_max": round(max(gaps), 4) if gaps else None,
        "prompt_tokens_p50": statistics.median(r["prompt_tokens"] for r in results),
    }


def ratios(report: dict) -> list[str]:
    """(a) against (b) and (c), and the control (d) against (b), at each level
    (``bench_docs.LOAD_RATIOS``): the ratio of the median throughputs, and the median of the
    ratios within each round (the setups of a round run back to back, so slow drifts of a shared
    machine cancel in them), as the page shows them (``bench_docs.load_ratio``)."""
    import bench_docs

    lines = []
    for numerator, other in bench_docs.LOAD_RATIOS:
        for paired, label in ((False, "tokens/s"), (True, "within rounds (median)")):
            values = bench_docs.load_ratio(report, other, paired, numerator)
            if values:
                levels = ", ".join(f"c={c}: {v:.3f}" for c, v in values.items())
                lines.append(f"- ({numerator}) / ({other}) {label}: {levels}")
    return lines


def markdown(report: dict) -> str:
    keys = ["concurrency", "tokens_per_second", "requests_per_second", "e2e_p50", "e2e_p95"]
    keys += ["ttft_p50", "ttft_p90", "itl_p50", "itl_p90"]
    lines = ["| setup | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
    for setup, levels in report["setups"].items():
        for r in levels:
            lines.append(f"| {setup} | " + " | ".join(str(r.get(k)) for k in keys) + " |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for setup, levels in report["setups"].items():
        conc = [r["concurrency"] for r in levels]
        left.plot(conc, [r["tokens_per_second"] for r in levels], marker="o", label=setup)
        right.plot(conc, [r["e2e_p95"] for r in levels], marker="o", label=setup)
    for ax, label in ((left, "generated tokens/s"), (right, "p95 end-to-end latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure(
    setups: dict[str, list[str]],
    conversations: list[list[dict[str, str]]],
    levels: list[int],
    args: argparse.Namespace,
    own_scopes: bool,
) -> dict[str, list[dict]]:
    """Start every setup's server, run each level ``repeats`` times with the setups taking turns
    in a rotating order, stop the servers; each setup's summary per level (``own_scopes``: as
    ``run_level``)."""
    names = list(setups)
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    runs: dict[str, list[list]] = {name: [[] for _ in levels] for name in names}
    try:
        start_servers(servers, setups, args)
        for li, c in enumerate(levels):
            for repeat in range(args.repeats):
                turn = names[repeat % len(names) :] + names[: repeat % len(names)]
                for name in turn:
                    url = f"http://127.0.0.1:{servers[name][1]}/v1"
                    requests = max(c * args.rounds, args.min_requests)
                    run = asyncio.run(run_level(url, conversations, c, requests, args.max_tokens, own_scopes))
                    runs[name][li].append(run)
                    tps = sum(r["tokens"] for r in run[0]) / run[1]
                    print(
                        f"  c={c} repeat {repeat + 1}/{args.repeats} {name}: {tps:.1f} tokens/s",
                        file=sys.stderr,
                    )
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=60)
    return {name: [summarise(c, runs[name][li]) for li, c in enumerate(levels)] for name in names}


async def interference_trial(base_url: str, long_prompt: list[int], salt: str, warm_chunks: int = 8) -> dict:
    """A greedy stream runs (``warm_chunks`` text chunks first); then the long prompt arrives
    (one token asked); the stream is closed shortly after that request returns. The gaps
    between the stream's text chunks before it arrived, and those overlapping its wait. The
    stream decodes in the cache scope ``salt`` (one per trial), so it never copies an earlier
    trial's stream of the same prompt."""
    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    model = await served_model(client)
    stream = await client.completions.create(
        model=model,
        prompt=STREAM_PROMPT,
        max_tokens=STREAM_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "cache_salt": salt},
    )
    times: list[float] = []

    async def read() -> None:
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter())

    reader = asyncio.ensure_future(read())
    while len(times) < warm_chunks and not reader.done():
        await asyncio.sleep(0.005)
    sent = time.perf_counter()
    await client.completions.create(model=model, prompt=long_prompt, max_tokens=1, temperature=0)
    done = time.perf_counter()
    await asyncio.sleep(0.5)  # a few more chunks: the pause that ends after the prefill counts
    reader.cancel()
    await stream.close()
    await client.close()
    pairs = list(itertools.pairwise(times))
    before = [b - a for a, b in pairs if b <= sent]
    during = [b - a for a, b in pairs if b > sent and a < done]
    return {
        "pause_max": round(max(during), 4) if during else round(done - sent, 4),
        "pause_p50": round(statistics.median(during), 4) if during else None,
        "steady_gap": round(statistics.median(before), 4) if before else None,
        "stream_chunks_during": len(during),
        "long_latency": round(done - sent, 3),
    }


def prefill_chunk(port: int) -> int:
    """The chunk a server prefills per step (``multiguess_prefill_chunk_tokens``; 0: whole)."""
    import httpx

    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith("multiguess_prefill_chunk_tokens "):
            return int(float(line.split()[1]))
    raise RuntimeError("the server does not report multiguess_prefill_chunk_tokens")


def measure_interference(setups: dict[str, list[str]], args: argparse.Namespace) -> dict[str, dict]:
    """Every setup's server, ``repeats`` trials each, the setups taking turns in a rotating order;
    per setup the chunk and the medians over trials (the trials too)."""
    names = list(setups)
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    trials: dict[str, list[dict]] = {name: [] for name in names}
    ids = random.Random(args.long_tokens)
    try:
        start_servers(servers, setups, args)
        for repeat in range(args.repeats):
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                prompt = [ids.randrange(1000, 40000) for _ in range(args.long_tokens)]
                url = f"http://127.0.0.1:{servers[name][1]}/v1"
                trial = asyncio.run(interference_trial(url, prompt, f"{name}-{repeat}"))
                trials[name].append(trial)
                print(f"  repeat {repeat + 1}/{args.repeats} {name}: {trial}", file=sys.stderr)
        chunks = {name: prefill_chunk(port) for name, (_, port) in servers.items()}
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=60)
    keys = ["pause_max", "pause_p50", "steady_gap", "long_latency"]
    return {
        name: {
            "chunk": chunks[name],
            **{k: statistics.median(t[k] for t in trials[name] if t[k] is not None) for k in keys},
            "trials": trials[name],
        }
        for name in names
    }


def shared_ratios(report: dict) -> list[str]:
    """What prefix caching and chunked prefill change at each level (``bench_docs.SHARED_RATIOS``)."""
    import bench_docs

    setups = {name[0]: levels for name, levels in report["setups"].items()}
    clients = [r["concurrency"] for r in next(iter(setups.values()))]
    return [
        f"- {label}: "
        + ", ".join(
            f"c={c}: {v}"
            for c, v in zip(clients, bench_docs.shared_ratio(setups[x], setups[y], key), strict=True)
        )
        for label, x, y, key in bench_docs.SHARED_RATIOS
        if x in setups and y in setups
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload", choices=("mixed", "shared-prompt", "long-prompt", "grounded"), default="mixed"
    )
    parser.add_argument(
        "--concurrency", default=None, help="levels (default: 1,2,4,8,16; shared-prompt 1,4,8)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="requests per client at each level")
    parser.add_argument(
        "--min-requests", type=int, default=8, help="requests per level at least (low concurrency is noisy)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per level and setup (median)")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="per reply (default: 64; grounded: as bench/grounded.py)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--setups", default=None, help="which setups to run, by letter: ab or a,b (default: all)"
    )
    parser.add_argument("--chunk", type=int, default=256, help="--max-prefill-tokens of the chunked setups")
    parser.add_argument(
        "--long-tokens", type=int, default=2000, help="long-prompt: the arriving prompt's tokens"
    )
    parser.add_argument(
        "--serve-args", default="", help="more flags for every server, e.g. '--dtype float32'"
    )
    parser.add_argument("--out", type=Path, default=Path("docs"))
    args = parser.parse_args()
    import bench_docs
    from multiguess.benchmark import load_prompts
    from multiguess.provenance import provenance

    if args.max_tokens is None:  # grounded replies copy passages and files: as long as at batch 1
        from grounded import MAX_TOKENS

        args.max_tokens = MAX_TOKENS if args.workload == "grounded" else 64
    if args.workload == "long-prompt":
        return long_prompt(args)
    if args.workload == "grounded":
        return grounded(args)
    shared = args.workload == "shared-prompt"
    system = SYSTEM_PROMPT if shared else None
    conversations = [messages_for(p["text"], system) for p in load_prompts()[1]]
    levels = [int(c) for c in (args.concurrency or ("1,4,8" if shared else "1,2,4,8,16")).split(",")]
    every = shared_setups(args.chunk) if shared else SETUPS
    letters = {name[0] for name in every}
    chosen = set(args.setups.replace(",", "")) if args.setups else letters
    if not chosen <= letters:
        parser.error(
            f"--setups: no setup {', '.join(sorted(chosen - letters))} (setups: {''.join(sorted(letters))})"
        )
    setups = {name: flags for name, flags in every.items() if name[0] in chosen}
    report = {**provenance(), "workload": args.workload, "max_tokens": args.max_tokens}
    report |= {"rounds": args.rounds, "min_requests": args.min_requests, "repeats": args.repeats}
    own_scopes = not shared  # the mixed workload: its prompts come round again
    report |= {"own_scopes": True} if own_scopes else {}
    report |= {"serve_args": args.serve_args} if args.serve_args else {}
    report |= {"chunk": args.chunk, "system_prompt_chars": len(SYSTEM_PROMPT)} if shared else {}
    report["setups"] = measure(setups, conversations, levels, args, own_scopes)
    (args.out / "bench").mkdir(parents=True, exist_ok=True)
    if shared:
        (args.out / "bench" / bench_docs.SHARED_FILE).write_text(json.dumps(report, indent=2) + "\n")
        summary = shared_ratios(report)
    else:
        (args.out / "img").mkdir(parents=True, exist_ok=True)
        (args.out / "bench" / bench_docs.LOAD_FILE).write_text(json.dumps(report, indent=2) + "\n")
        plot(report, args.out / "img" / "load.png")
        summary = ratios(report)
    bench_docs.write(args.out)
    print("\n".join([markdown(report), "", *summary]))
    return 0


def grounded(args: argparse.Namespace) -> int:
    """The grounded workloads at 1, 4 and 8 clients (``grounded_load.py``): measure, write
    their JSON, render the pages."""
    import bench_docs
    import grounded_load
    from multiguess.provenance import provenance

    report = {**provenance(), "workload": args.workload, "max_tokens": args.max_tokens}
    report |= {"rounds": args.rounds, "repeats": args.repeats}
    report |= grounded_load.run(args, start_servers)
    (args.out / "bench").mkdir(parents=True, exist_ok=True)
    (args.out / "bench" / bench_docs.GROUNDED_LOAD_FILE).write_text(json.dumps(report, indent=2) + "\n")
    bench_docs.write(args.out)
    for workload, result in report["workloads"].items():
        print(workload, json.dumps(result["rows"]))
    return 0


def long_prompt(args: argparse.Namespace) -> int:
    """The long-prompt interference workload: measure, write its JSON, render the pages."""
    import bench_docs
    from multiguess.provenance import provenance

    report = {**provenance(), "workload": args.workload, "long_tokens": args.long_tokens}
    report |= {"repeats": args.repeats} | ({"serve_args": args.serve_args} if args.serve_args else {})
    report["setups"] = measure_interference(LONG_SETUPS, args)
    (args.out / "bench").mkdir(parents=True, exist_ok=True)
    (args.out / "bench" / bench_docs.LONG_FILE).write_text(json.dumps(report, indent=2) + "\n")
    bench_docs.write(args.out)
    print(
        json.dumps(
            {name: {k: v for k, v in r.items() if k != "trials"} for name, r in report["setups"].items()}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
