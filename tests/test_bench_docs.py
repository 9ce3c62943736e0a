"""docs/BENCHMARKS.md and the README's headline are renderings of docs/bench/*.json, nothing else."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_docs  # noqa: E402


def test_committed_benchmarks_page_is_the_rendering_of_the_committed_json() -> None:
    """A number edited by hand in BENCHMARKS.md, or a JSON result without its page, fails here."""
    assert (ROOT / "docs" / "BENCHMARKS.md").read_text() == bench_docs.render(ROOT / "docs")


def test_readme_headline_is_the_rendering_of_the_committed_json() -> None:
    readme = (ROOT / "README.md").read_text()
    assert bench_docs.headline(ROOT / "docs" / "bench") in readme


def test_every_recorded_result_names_its_commit_machine_and_command() -> None:
    for path in sorted((ROOT / "docs" / "bench").glob("*.json")):
        record = bench_docs.provenance_of(json.loads(path.read_text()))
        assert record.get("commit") and record.get("machine") and record.get("date"), path.name
    page = bench_docs.render(ROOT / "docs")
    sections = page.split("\n## ")[1:]
    assert len(sections) == len(bench_docs.SECTIONS)
    for section in sections:
        assert "Reproduce: `" in section or "No result recorded yet" in section or "Not yet run" in section


def test_an_engine_run_is_reproduced_with_the_weights_it_had() -> None:
    """On CPUs the embedded target defaults to its Q4_1 file: a bf16 run says so."""
    run = {"dtype": "bfloat16", "quantization": "none", "max_tokens": 96, "repeats": 3}
    assert bench_docs.engine_command(run) == "multiguess bench --dtype bfloat16 --quantization none"
    assert bench_docs.engine_command({**run, "quantization": "auto"}) == "multiguess bench --dtype bfloat16"


def test_empty_results_render_as_not_yet_measured(tmp_path: Path) -> None:
    (tmp_path / "bench").mkdir()
    page = bench_docs.render(tmp_path)
    assert page.count("No result recorded yet") == 12
    assert "Not yet run on a GPU" in page
    assert "No results recorded yet." in bench_docs.headline(tmp_path / "bench")


def test_write_replaces_the_page_and_only_the_readme_headline(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs" / "bench", docs / "bench")
    (docs / "BENCHMARKS.md").write_text("stale\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{bench_docs.HEADLINE_START}\nold\n{bench_docs.HEADLINE_END}\noutro\n")
    report = json.loads((docs / "bench" / "results-bfloat16.json").read_text())
    tree = next(r for r in report["methods"] if r["method"] == "multiguess tree")
    tree["speedup_vs_generate"] = 9.876
    plain = next(r for r in report["methods"] if r["method"] == "multiguess plain")
    tree["tokens_per_second"] = round(1.25 * plain["tokens_per_second"], 2)
    sampled = {"method": "multiguess plain, sampled", "tokens_per_second": plain["tokens_per_second"] / 2}
    report["methods"] = [r for r in report["methods"] if r["method"] != sampled["method"]] + [sampled]
    report["commit"] = "abc1234"
    (docs / "bench" / "results-bfloat16.json").write_text(json.dumps(report))
    bench_docs.write(docs)
    page = (docs / "BENCHMARKS.md").read_text()
    assert (
        "Commit `abc1234`" in page
        and f"| multiguess tree | {bench_docs.fmt(tree['tokens_per_second'])} | 9.88 |" in page
    )
    assert "| multiguess plain, sampled | " in page and " |  |  | 0.50 | " in page  # × multiguess plain
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old" not in text
    assert "tree 9.88× `generate`" in text and "`abc1234`" in text
    assert "1.25× multiguess plain; sampled plain decoding 0.50× greedy" in text


def test_shared_prompt_results_render_with_their_ratios(tmp_path: Path) -> None:
    """The shape ``bench/serving_load.py --workload shared-prompt`` writes."""

    def level(ttft: float, itl: float) -> dict:
        timings = {"ttft_p50": ttft, "ttft_p90": 2 * ttft, "itl_p50": itl / 2, "itl_p90": itl}
        timings["itl_max"] = 3 * itl
        return {"concurrency": 4, "tokens_per_second": 50.0, "prompt_tokens_p50": 420, **timings}

    setups = {"a: both": [level(0.2, 0.05)], "b: prefix": [level(0.25, 0.1)]}
    setups |= {"c: chunked": [level(0.8, 0.06)], "d: neither": [level(1.0, 0.2)]}
    report = {"commit": "beef123", "date": "today", "machine": "m", "workload": "shared-prompt"}
    report |= {"max_tokens": 64, "rounds": 2, "min_requests": 8, "repeats": 3, "chunk": 256, "setups": setups}
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / bench_docs.SHARED_FILE).write_text(json.dumps(report))
    page = bench_docs.render(tmp_path)
    assert "Commit `beef123`" in page and "(420 prompt tokens at the median)" in page
    assert "| a: both | 4 | 200.00 | 400.00 | 25.00 | 50.00 | 150.00 | 50.00 |" in page
    assert "| TTFT p50: prefix caching / none (b / d) | 0.250 |" in page
    assert "| ITL p90: chunked / whole prefills (a / b) | 0.500 |" in page


def test_long_prompt_results_render_with_the_pause_ratio(tmp_path: Path) -> None:
    """The shape ``bench/serving_load.py --workload long-prompt`` writes."""

    def setup(chunk: int, pause: float, latency: float) -> dict:
        timings = {"pause_max": pause, "pause_p50": pause / 2, "steady_gap": 0.03, "long_latency": latency}
        return {"chunk": chunk, **timings, "trials": []}

    report = {"commit": "cafe123", "date": "today", "machine": "m", "workload": "long-prompt"}
    report |= {"long_tokens": 2000, "repeats": 3}
    report["setups"] = {
        "a: chunked prefill (default)": setup(128, 0.2, 5.0),
        "b: whole prefills": setup(0, 4.0, 4.0),
    }
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / bench_docs.LONG_FILE).write_text(json.dumps(report))
    page = bench_docs.render(tmp_path)
    assert "Commit `cafe123`" in page and "a 2000-token prompt" in page
    assert "| a: chunked prefill (default) | 128 | 200.00 | 100.00 | 30.00 | 5.00 |" in page
    assert "| b: whole prefills | whole | 4000.00 | 2000.00 | 30.00 | 4.00 |" in page
    assert "longest pause is 0.050x the whole prefill's, and the long request takes 1.250x" in page


def gpu_check(device: str) -> dict:
    """The shape ``bench/gpu_check.py`` writes."""
    environment = {"commit": "f00d123", "device": device, "dtype": "bfloat16", "torch": "2.13.0"}
    environment |= {"transformers": "5.0", "gpu": "NVIDIA H200", "gpu_memory_gib": 139.8}
    row = {"case": "tree, batch 1", "status": "pass", "tokens_per_second": 123.4, "vs_plain": 1.9}
    section = {"name": "(b) speed llama-1b", "status": "ok", "seconds": 12.0, "rows": [row], "note": ""}
    return {"environment": environment, "seconds": 300.0, "passed": True, "sections": [section]}


def test_gpu_check_renders_when_a_cuda_run_is_recorded(tmp_path: Path) -> None:
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / bench_docs.GPU_FILE).write_text(json.dumps(gpu_check("cuda:0")))
    page = bench_docs.render(tmp_path)
    assert "Not yet run on a GPU" not in page
    assert "Commit `f00d123`" in page and "NVIDIA H200, 139.8 GiB" in page
    assert "| (b) speed llama-1b | tree, batch 1 | pass | 123.40 | 1.90 |  |" in page
    assert "| GPU check | passed on NVIDIA H200, 139.8 GiB | `f00d123` |" in bench_docs.headline(
        tmp_path / "bench"
    )


def test_a_gpu_check_dry_run_on_the_cpu_is_not_a_gpu_result(tmp_path: Path) -> None:
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / bench_docs.GPU_FILE).write_text(json.dumps(gpu_check("cpu")))
    assert "Not yet run on a GPU" in bench_docs.render(tmp_path)


def test_grounded_section_shows_each_workload_and_setup_against_plain() -> None:
    row = {
        "drafter": "suffix",
        "tokens_per_second": 40.0,
        "mean_accepted_length": 5.5,
        "identical_to_plain": True,
    }
    report = {
        "commit": "abc1234",
        "date": "2026-01-01 00:00 UTC",
        "machine": "a CPU",
        "repeats": 2,
        "max_tokens": 96,
        "batch": 1,
        "rows": [
            {**row, "workload": "extraction", "weights": "Q4_1", "setup": "suffix", "vs_plain": 3.21},
            {
                **row,
                "workload": "open chat",
                "weights": "bfloat16",
                "setup": "suffix",
                "vs_plain": 0.99,
                "identical_to_plain": False,
            },
        ],
    }
    lines = bench_docs.grounded_section(report)
    assert "| extraction | Q4_1 | suffix | suffix | 40.0 | 3.21 | 5.50 | yes |" in lines
    assert "| open chat | bfloat16 | suffix | suffix | 40.0 | 0.99 | 5.50 | no |" in lines
    assert any("abc1234" in line for line in lines)


def test_grounded_headline_states_the_predicted_own_reply_apart_from_the_range() -> None:
    """The code edits predicting their own replies show what the engine makes of a right
    prediction; they are not a workload's reply copying its input, so not in that range."""
    row = {"weights": "Q4_1", "setup": "default", "identical_to_plain": True}
    report = {
        "rows": [
            {**row, "workload": "extraction", "vs_plain": 1.8},
            {**row, "workload": "agent loop", "vs_plain": 2.0},
            {**row, "workload": "open chat", "vs_plain": 1.4},
            {**row, "workload": bench_docs.GROUNDED_CEILING, "vs_plain": 2.6},
            {**row, "workload": "open chat", "setup": "plain", "vs_plain": 1.0},
        ]
    }
    assert bench_docs.grounded_headline(report) == (
        "Q4_1: replies that copy their input 1.80–2.00× plain decoding, open chat 1.40×, a code "
        "edit predicting its own reply 2.60× (default drafter); output identical to plain in 4 of 4 runs"
    )


def grounded_load_report(rows: dict[str, list[dict]], levels: list[int], weights: dict[str, str]) -> dict:
    """A grounded load report of ``rows`` by workload, at ``levels``, setups on ``weights``."""
    return {
        "commit": "abc1234",
        "date": "2026-01-01 00:00 UTC",
        "machine": "a CPU",
        "repeats": 3,
        "max_tokens": 160,
        "levels": levels,
        "workloads": {workload: {"rows": r} for workload, r in rows.items()},
        "target_weights": weights,
    }


def test_grounded_load_section_shows_each_workload_and_client_count_against_plain() -> None:
    rows = [
        {"clients": c, "setup": s, "tokens_per_second": 50.0, "vs_plain": v, "mean_accepted_length": m}
        | {"identical_to_plain": True, "requests": 8}
        for c, s, v, m in (
            (4, "plain", 1.0, 1.0),
            (4, "default", 2.05, 4.2),
            (4, "suffix", 1.95, 3.9),
            (4, "plain bf16", 1.0, 1.0),
            (4, "default bf16", 2.5, 4.4),
        )
    ]
    weights = {"plain": "Q4_1", "default": "Q4_1", "suffix": "Q4_1"}
    weights |= {"plain bf16": "bfloat16", "default bf16": "bfloat16"}
    report = grounded_load_report({"code edit + prediction": rows}, [1, 4, 8], weights)
    lines = bench_docs.grounded_load_section(report)
    assert "| code edit + prediction | 4 | Q4_1 | default | 50.0 | 2.05 | 4.20 | yes |" in lines
    assert "`control`" not in "\n".join(lines)  # a run without a second plain server says nothing of one
    assert "| code edit + prediction | 4 | Q4_1 | suffix | 50.0 | 1.95 | 3.90 | yes |" in lines
    assert "| code edit + prediction | 4 | bfloat16 | default | 50.0 | 2.50 | 4.40 | yes |" in lines
    assert not any("| plain |" in line for line in lines)  # plain is the reference, not a row
    assert any("abc1234" in line for line in lines)
    assert any("No result recorded yet" in line for line in bench_docs.grounded_load_section(None))


def test_grounded_load_section_shows_the_control_server_against_plain() -> None:
    """The second plain server is a row of its own (its ratio is the run's spread between two
    identical servers), and the text says what it is."""
    rows = [
        {"clients": 8, "setup": s, "tokens_per_second": t, "vs_plain": v, "mean_accepted_length": 1.0}
        | {"identical_to_plain": True, "requests": 16}
        for s, t, v in (("plain", 100.0, 1.0), ("control", 96.0, 0.96))
    ]
    report = grounded_load_report({"open chat": rows}, [8], {"plain": "Q4_1", "control": "Q4_1"})
    report["setups"] = {"plain": [], "control": []}
    lines = bench_docs.grounded_load_section(report)
    assert "| open chat | 8 | Q4_1 | control | 96.0 | 0.96 | 1.00 | yes |" in lines
    assert "a second server with plain decoding's flags (`control`" in "\n".join(lines)


def test_speculation_bound_section_shows_each_workload_by_client_count() -> None:
    rows = [
        {
            "workload": w,
            "weights": "Q4_1",
            "clients": c,
            "prompt_tokens": 150.0,
            "reply_tokens": 120.5,
            "bound": b,
            "copies_bound": copies,
        }
        for w, c, b, copies in (
            ("code edit", 1, 3.5, 2.2),
            ("code edit", 4, 1.58, 1.3),
            ("open chat", 1, 4.4, 1.1),
            ("open chat", 4, 1.9, 1.0),
        )
    ]
    measured = {"weights": "Q4_1", "context": 160, "widest": 33}
    measured |= {
        "forward_ms": {"1": [5.3, 28.0], "4": [6.0, 110.0]},
        "outside_forward_ms": {"1": 0.8, "4": 1.6},
    }
    report = {"commit": "abc1234", "date": "d", "machine": "m", "max_tokens": 160, "clients": [1, 4]}
    lines = bench_docs.speculation_bound_section(report | {"measured": [measured], "rows": rows})
    assert "| code edit | Q4_1 | 150 | 120 | 3.50 | 1.58 | 2.20 | 1.30 |" in lines
    assert "| open chat | Q4_1 | 150 | 120 | 4.40 | 1.90 | 1.10 | 1.00 |" in lines
    assert "| Q4_1 | 160 | 33 | 5.30 / 28.00 / 0.80 | 6.00 / 110.00 / 1.60 |" in lines
    assert any("abc1234" in line for line in lines)
    assert any("No result recorded yet" in line for line in bench_docs.speculation_bound_section(None))


def test_bound_headline_gives_each_client_counts_range_on_the_default_weights() -> None:
    rows = [
        {"workload": w, "weights": q, "clients": c, "bound": b, "copies_bound": b / 2}
        for w, q, c, b in (
            ("code edit", "Q4_1", 1, 4.11),
            ("open chat", "Q4_1", 1, 6.08),
            ("code edit", "Q4_1", 4, 1.82),
            ("open chat", "Q4_1", 4, 2.4),
            ("code edit", "bfloat16", 1, 9.0),
        )
    ]
    assert bench_docs.bound_headline({"clients": [1, 4], "rows": rows}) == (
        "Q4_1, every drafted token accepted, drafting free: 4.11–6.08× plain at 1 client (code edit "
        "4.11×, 2.06× drafting copies alone), 1.82–2.40× plain at 4 clients (code edit 1.82×, 0.91× "
        "drafting copies alone)"
    )


def test_llama_cpp_headline_reads_the_ratios_to_llama_cpp_plain() -> None:
    ratio = "vs llama.cpp plain, Q4_1"
    methods = [
        {"method": "multiguess plain, Q4_1", ratio: 1.954},
        {"method": "multiguess tree, Q4_1", ratio: 1.835},
        {"method": "llama.cpp speculative, Q4_1", ratio: 0.416},
    ]
    assert bench_docs.llama_cpp_headline({"methods": methods}) == (
        "on the same Q4_1 GGUF: multiguess plain 1.95×, multiguess default 1.83×, "
        "llama.cpp's speculation 0.42× llama.cpp plain"
    )
    headline = bench_docs.llama_cpp_headline({"methods": methods, "llama_args": "--no-repack"})
    assert headline.endswith("llama.cpp plain (llama.cpp run with `--no-repack`)")


def test_llama_cpp_command_names_the_options_a_run_changed() -> None:
    report = {"prompts": 8, "repeats": 5, "max_tokens": 96, "threads": 2, "draft_max": 4}
    assert bench_docs.llama_cpp_command(report) == ".venv/bin/python bench/llama_cpp.py --repeats 5"
    report["llama_args"] = "--no-repack"
    assert bench_docs.llama_cpp_command(report).endswith("--repeats 5 --llama-args='--no-repack'")


def test_load_headline_states_the_lowest_level_beside_the_ends() -> None:
    """The headline reads the medians within rounds at the fewest and most clients, and where
    batched speculation is lowest when that is another level."""

    def level(clients: int, runs: list[float]) -> dict:
        return {"concurrency": clients, "tokens_per_second": 0.0, "tokens_per_second_runs": runs}

    report = {
        "setups": {
            "a: batched + adaptive speculation": [
                level(1, [10, 12, 11]),
                level(4, [9, 9, 9]),
                level(16, [30]),
            ],
            "b: batched, no speculation": [level(1, [10, 10, 10]), level(4, [10, 10, 10]), level(16, [20])],
        }
    }
    assert bench_docs.load_headline(report) == (
        "batched speculation / batched plain (medians within rounds): 1.10 at 1, 1.50 at 16 "
        "clients, lowest 0.90 at 4 clients"
    )
    report["setups"]["a: batched + adaptive speculation"][1] = level(4, [12, 12, 12])
    assert bench_docs.load_headline(report) == (
        "batched speculation / batched plain (medians within rounds): 1.10 at 1, 1.50 at 16 clients"
    )
    report["setups"]["d: batched, no speculation, a second server"] = [
        level(1, [9, 10, 10]),
        level(4, [11, 11, 12]),
        level(16, [21]),
    ]
    assert bench_docs.load_headline(report) == (
        "batched speculation / batched plain (medians within rounds): 1.10 at 1, 1.50 at 16 clients "
        "(a second batched plain server against the first: 1.00–1.10)"
    )
    assert bench_docs.load_ratio(report, "b", paired=True, numerator="d") == {1: 1.0, 4: 1.1, 16: 1.05}
