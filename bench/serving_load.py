"""Load benchmark over HTTP: throughput and latency against concurrency, three server setups.

Starts real ``multiguess serve`` processes on 127.0.0.1 with the embedded pair, all setups at
once (an idle server uses no CPU), and drives them with an async streaming client (the ``openai``
package) at several concurrency levels:

    (a) batched + adaptive speculation  (--max-batch 16)
    (b) batched, no speculation         (--max-batch 16 --drafter none)
    (c) unbatched speculation           (--max-batch 1)

Machines are noisy (±5% between runs here), so each level is run ``--repeats`` times, the setups
taking turns in a rotating order, and throughput is the median over repeats; latencies pool
every request of a level. Reports generated tokens/s, requests/s, p50/p95 end-to-end latency and
time to first token, (a) relative to (b) and (c), and writes JSON and a plot under docs/, from
which docs/BENCHMARKS.md is rendered again (``multiguess.bench_docs``).
Run: ``.venv/bin/python bench/serving_load.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from local_server import free_port, start_ready
from openai import AsyncOpenAI

SETUPS = {
    "a: batched + adaptive speculation": ["--max-batch", "16"],
    "b: batched, no speculation": ["--max-batch", "16", "--drafter", "none"],
    "c: unbatched speculation": ["--max-batch", "1"],
}


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


async def one_request(client: AsyncOpenAI, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    first = None
    tokens = 0
    stream = await client.chat.completions.create(
        model="multiguess-default",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    total = time.perf_counter() - start
    return {"ttft": first if first is not None else total, "e2e": total, "tokens": tokens}


async def run_level(
    base_url: str, prompts: list[str], concurrency: int, requests: int, max_tokens: int
) -> tuple[list[dict], float]:
    """Every request's timings and the wall time of ``requests`` requests from ``concurrency`` clients."""
    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    queue = [prompts[i % len(prompts)] for i in range(requests)]
    results: list[dict] = []

    async def worker() -> None:
        while queue:
            results.append(await one_request(client, queue.pop(), max_tokens))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    return results, wall


def summarise(concurrency: int, runs: list[tuple[list[dict], float]]) -> dict:
    """Median throughput over repeated runs; latency percentiles over all their requests."""
    results = [r for run, _ in runs for r in run]

    def pct(key: str, q: float) -> float:
        values = sorted(r[key] for r in results)
        return round(values[min(len(values) - 1, int(q * len(values)))], 3)

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
        "ttft_p95": pct("ttft", 0.95),
    }


def ratios(report: dict) -> list[str]:
    """(a) against (b) and (c) at each level: the ratio of the median throughputs, and the median
    of the ratios within each round (the setups of a round run back to back, so slow drifts of
    a shared machine cancel in them)."""
    setups = {name[0]: levels for name, levels in report["setups"].items()}
    lines = []
    for other in ("b", "c"):
        if "a" in setups and other in setups:
            pairs = list(zip(setups["a"], setups[other], strict=True))
            medians = ", ".join(
                f"c={a['concurrency']}: {a['tokens_per_second'] / o['tokens_per_second']:.3f}"
                for a, o in pairs
            )
            paired = ", ".join(
                f"c={a['concurrency']}: "
                f"{statistics.median(x / y for x, y in zip(a['tokens_per_second_runs'], o['tokens_per_second_runs'], strict=True)):.3f}"
                for a, o in pairs
            )
            lines.append(f"- (a) / ({other}) tokens/s: {medians}")
            lines.append(f"- (a) / ({other}) within rounds (median): {paired}")
    return lines


def markdown(report: dict) -> str:
    lines = [
        "| setup | concurrency | tokens/s | requests/s | e2e p50 s | e2e p95 s | TTFT p50 s | TTFT p95 s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for setup, levels in report["setups"].items():
        for r in levels:
            lines.append(
                f"| {setup} | {r['concurrency']} | {r['tokens_per_second']} | {r['requests_per_second']} | "
                f"{r['e2e_p50']} | {r['e2e_p95']} | {r['ttft_p50']} | {r['ttft_p95']} |"
            )
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--rounds", type=int, default=2, help="requests per client at each level")
    parser.add_argument(
        "--min-requests", type=int, default=8, help="requests per level at least (low concurrency is noisy)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per level and setup (median)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--setups", default="a,b,c", help="which setups to run (letters)")
    parser.add_argument("--out", type=Path, default=Path("docs"))
    args = parser.parse_args()
    from multiguess import bench_docs
    from multiguess.benchmark import load_prompts

    prompts = [p["text"] for p in load_prompts()[1]]
    levels = [int(c) for c in args.concurrency.split(",")]
    names = [name for name in SETUPS if name[0] in set(args.setups.split(","))]
    report = {**bench_docs.provenance(), "max_tokens": args.max_tokens}
    report |= {"rounds": args.rounds, "min_requests": args.min_requests, "repeats": args.repeats}
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    try:
        for name in names:
            port = free_port()
            print(f"starting {name} ...", file=sys.stderr)
            servers[name] = (start_server(SETUPS[name], port, args.threads), port)
        runs: dict[str, list[list]] = {name: [[] for _ in levels] for name in names}
        for li, c in enumerate(levels):
            for repeat in range(args.repeats):
                turn = names[repeat % len(names) :] + names[: repeat % len(names)]
                for name in turn:
                    port = servers[name][1]
                    requests = max(c * args.rounds, args.min_requests)
                    run = asyncio.run(
                        run_level(f"http://127.0.0.1:{port}/v1", prompts, c, requests, args.max_tokens)
                    )
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
    report["setups"] = {name: [summarise(c, runs[name][li]) for li, c in enumerate(levels)] for name in names}
    (args.out / "bench").mkdir(parents=True, exist_ok=True)
    (args.out / "img").mkdir(parents=True, exist_ok=True)
    (args.out / "bench" / "load.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out / "img" / "load.png")
    bench_docs.write(args.out)
    print("\n".join([markdown(report), "", *ratios(report)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
