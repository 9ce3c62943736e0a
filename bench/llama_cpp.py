"""multiguess against llama.cpp on the same GGUF files and prompts, taking turns in one run.

llama.cpp is built from the ``llama-cpp-python`` sdist on PyPI and cached
(``bench/llama_cpp_build.py``; ~15 minutes on 2 cores the first time). Its ``llama-server``
decodes plainly and speculatively (the shipped draft, converted to GGUF) on the embedded
target's Q4_1 file as shipped and on its bf16 conversion; multiguess decodes plainly and with
its default tree on the same two. The chat prompts of ``multiguess bench`` go to both as the
same token ids, greedy, with the same thread count, the methods alternating prompt by prompt.
Reported per method: tokens/s end to end (prefill included; the median over repeats), ratios
within each repeat, and whether each speculative method's output equals its own plain
decoding of the same file. Without a compiler it skips and says why.

    .venv/bin/python bench/llama_cpp.py                # docs/bench/llama-cpp.json, BENCHMARKS.md
    .venv/bin/python bench/llama_cpp.py --build-only   # build and convert, measure nothing
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_docs
from llama_cpp_build import VERSION, BuildUnavailable, LlamaCpp, build
from llama_cpp_models import BenchModels, prepare_models
from llama_cpp_server import LlamaServer, ServerConfig
from multiguess import benchmark as bm
from multiguess.provenance import provenance

Generator = Callable[[list[int]], list[int]]
# Each speculative method and the plain decoding of the same file it must reproduce.
OWN_PLAIN = {
    "llama.cpp speculative, Q4_1": "llama.cpp plain, Q4_1",
    "llama.cpp speculative, bf16": "llama.cpp plain, bf16",
    "multiguess tree, bf16": "multiguess plain, bf16",
    "multiguess tree, Q4_1": "multiguess plain, Q4_1",
}
REFERENCES = ("multiguess plain, bf16", "llama.cpp plain, Q4_1")  # the ratio columns


def llama_servers(stack: ExitStack, binary: Path, models: BenchModels, args: argparse.Namespace) -> dict:
    """The four llama.cpp methods, each its own server: plain and speculative, Q4_1 and bf16."""
    logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="llama-server-")))
    extra = tuple(shlex.split(args.llama_args))

    def config(model: Path, draft: Path | None = None) -> ServerConfig:
        return ServerConfig(model, args.threads, draft, args.draft_max, extra)

    configs = {
        "llama.cpp plain, Q4_1": config(models.target_q4_1),
        "llama.cpp plain, bf16": config(models.target_bf16),
        "llama.cpp speculative, Q4_1": config(models.target_q4_1, models.draft_bf16),
        "llama.cpp speculative, bf16": config(models.target_bf16, models.draft_bf16),
    }
    servers = {}
    for i, (name, config) in enumerate(configs.items()):
        servers[name] = stack.enter_context(LlamaServer(binary, config, logs / f"server-{i}.log"))
        print(f"started {name}: {' '.join(servers[name].command)}", file=sys.stderr, flush=True)
    return servers


def llama_generator(
    server: LlamaServer, max_tokens: int, result: bm.MethodResult, decode: list[float]
) -> Generator:
    """One greedy completion; the server's drafted/accepted counts go into ``result`` and its
    decode-only tokens/s into ``decode``. Every step after the prefill's first token yields
    one token plus those it accepted, so the steps are ``predicted - 1 - accepted``."""

    def run(prompt: list[int]) -> list[int]:
        tokens, timings = server.complete(prompt, max_tokens)
        result.draft_tokens += timings.drafted
        result.accepted_tokens += timings.accepted
        result.verify_steps += max(1, timings.predicted_tokens - 1 - timings.accepted)
        decode.append(timings.decode_tokens_per_second)
        return tokens

    return run


def multiguess_engines(models: BenchModels) -> dict:
    """The four multiguess methods: the defaults of ``LLM`` with batch 1, no prefix cache (each
    repeat serves the same prompts again) and every prompt prefilled whole (the prompts are
    short; measuring a prefill chunk at start would only add to the load time), on the Q4_1
    file (the embedded default on CPUs) and on the bf16 folder (``quantization="none"``)."""
    from multiguess import LLM

    common = {"max_batch": 1, "prefix_caching": False, "max_prefill_tokens": None}
    bf16 = {"quantization": "none", **common}
    setups = {
        "multiguess plain, bf16": lambda: LLM(drafter="none", **bf16),
        "multiguess plain, Q4_1": lambda: LLM(drafter="none", **common),
        "multiguess tree, bf16": lambda: LLM(**bf16),
        "multiguess tree, Q4_1": lambda: LLM(**common),
    }
    engines, loads = {}, {}
    for name, make in setups.items():
        start = time.perf_counter()
        engines[name] = make().engine
        loads[name] = round(time.perf_counter() - start, 2)
    return {"engines": engines, "load_seconds": loads}


def fresh_copies(engine: object, run: Generator) -> Generator:
    """``run`` with the engine's recent-output index emptied first: a repeat must not copy the
    previous repeat's reply to the same prompt (llama.cpp keeps nothing between requests)."""
    from multiguess.engine.suffix import RecentOutputs

    def wrapped(prompt: list[int]) -> list[int]:
        engine.planner.copies.recent = RecentOutputs(engine.config.recent_outputs, engine.config.recent_age)
        return run(prompt)

    return wrapped


def chat(tokenizer: object, text: str) -> list[int]:
    """``text`` as one user message in the target's chat template, as the API sends it."""
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(templated, add_special_tokens=False)


def paired_ratio(result: bm.MethodResult, reference: bm.MethodResult) -> float:
    """The median over repeats of the within-repeat ratio of tokens/s."""
    pairs = zip(result.tokens_per_second, reference.tokens_per_second, strict=True)
    return round(statistics.median(a / b for a, b in pairs), 3)


def report_row(result: bm.MethodResult, results: dict[str, bm.MethodResult], decode: list[float]) -> dict:
    row: dict = {"method": result.name, "tokens_per_second": round(result.median_tps, 2)}
    row["repeats"] = [round(t, 2) for t in result.tokens_per_second]
    for reference in REFERENCES:
        row[f"vs {reference}"] = paired_ratio(result, results[reference])
    if result.name in OWN_PLAIN:
        row["identical_to_own_plain"] = result.identical_fraction(results[OWN_PLAIN[result.name]])
    if result.draft_tokens:
        row["mean_accepted_length"] = round(1 + result.accepted_tokens / max(1, result.verify_steps), 3)
        row["acceptance_rate"] = round(result.accepted_tokens / result.draft_tokens, 3)
    if decode:
        row["server_decode_tokens_per_second"] = round(statistics.median(decode), 2)
    return row


def measure(built: LlamaCpp, models: BenchModels, args: argparse.Namespace) -> dict:
    from multiguess.commands.engine_args import configure_threads

    configure_threads(args.threads)
    mg = multiguess_engines(models)
    tokenizer = mg["engines"]["multiguess plain, bf16"].tokenizer
    prompts = [chat(tokenizer, p["text"]) for p in bm.load_prompts()[1][: args.prompts]]
    results = {name: bm.MethodResult(name) for name in [*OWN_PLAIN.values(), *OWN_PLAIN]}
    decode: dict[str, list[float]] = {name: [] for name in results}
    with ExitStack() as stack:
        servers = llama_servers(stack, built.server, models, args)
        generators: dict[str, tuple[Generator, bm.MethodResult]] = {}
        for name, result in results.items():
            if name in servers:
                run = llama_generator(servers[name], args.max_tokens, result, decode[name])
            else:
                engine = mg["engines"][name]
                run = fresh_copies(engine, bm.engine_generator(engine, args.max_tokens, result))
            generators[name] = (run, result)
        warm = chat(tokenizer, "Say hello.")
        for run, _ in generators.values():  # kernels, caches, server threads; not counted
            run(warm)
        for result in results.values():
            result.draft_tokens = result.accepted_tokens = result.verify_steps = 0
        for series in decode.values():
            series.clear()
        bm.run_methods(
            generators, prompts, args.repeats, lambda line: print(line, file=sys.stderr, flush=True)
        )
        commands = {name: " ".join(server.command) for name, server in servers.items()}
    return {
        **provenance(),
        "llama_cpp_python": VERSION,
        "threads": args.threads,
        "repeats": args.repeats,
        "max_tokens": args.max_tokens,
        "prompts": len(prompts),
        "draft_max": args.draft_max,
        "llama_args": args.llama_args,
        "load_seconds": mg["load_seconds"],
        "llama_cpp_commands": commands,
        "methods": [report_row(r, results, decode[name]) for name, r in results.items()],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=8, help="the first N prompts of `multiguess bench`")
    parser.add_argument("--threads", type=int, default=2, help="for multiguess and llama.cpp alike")
    parser.add_argument(
        "--draft-max", type=int, default=4, help="llama.cpp's longest draft (--spec-draft-n-max)"
    )
    parser.add_argument(
        "--llama-args",
        default="",
        help="flags for every llama-server, as one string after '=' (--llama-args=--no-repack where "
        "its repacked AMX kernels crash: llama-cpp-python 0.3.36's on a 2-core Xeon with AMX)",
    )
    parser.add_argument(
        "--build-only", action="store_true", help="build llama.cpp and convert the files only"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("docs"), help="docs folder: bench/ JSON and BENCHMARKS.md"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        built = build()
    except BuildUnavailable as reason:
        print(f"bench/llama_cpp.py: skipped: {reason}", file=sys.stderr)
        return 0
    models = prepare_models(built)
    if args.build_only:
        print(f"llama.cpp ready: {built.server}; models: {models}")
        return 0
    report = measure(built, models, args)
    path = args.out / "bench" / bench_docs.LLAMA_CPP_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["methods"], indent=1))
    bench_docs.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
