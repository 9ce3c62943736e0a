"""`make gpu-check DEVICE=cpu`: the GPU check's dry run, so the prepared command cannot rot."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from multiguess.provenance import git_commit
from scipy.stats import chi2

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict]:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "OUT": str(out)}
    done = subprocess.run(
        ["make", "-s", "gpu-check", "DEVICE=cpu"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").exists() else {}
    return done, report


def test_the_dry_run_passes_and_prints_one_table(dry_run) -> None:
    done, report = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report["passed"] is True
    assert report["serving_only_modules_imported"] == []
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    assert table[0].startswith("| section | case | status | tok/s |")
    assert len(table) == 2 + sum(max(1, len(s["rows"])) for s in report["sections"])


def test_every_section_ran(dry_run) -> None:
    _, report = dry_run
    status = {s["name"]: s["status"] for s in report["sections"]}
    assert status == {
        "(0) fused attention": "ok",
        "(a) lossless greedy": "ok",
        "(a) sampling exactness": "ok",
        "(b) speed tiny-a": "ok",
        "(d) memory plan": "ok",
        "(c) CUDA graphs": "ok",
        "(e) long context": "ok",
        "(f) versions and device boundary": "ok",
    }
    assert report["environment"]["commit"] == git_commit()


def test_speculation_matched_plain_decoding_token_for_token(dry_run) -> None:
    _, report = dry_run
    sections = {s["name"]: s for s in report["sections"]}
    greedy = [r for r in sections["(a) lossless greedy"]["rows"] if r["case"].startswith("greedy")]
    assert len(greedy) == 10 and all(r["status"] == "pass" for r in greedy)
    sampled = sections["(a) sampling exactness"]["rows"]
    assert [r["status"] for r in sampled] == ["pass"] * 3  # seeded, unseeded, the draft's rejected
    assert "unseeded" in sampled[1]["case"]
    graphs = sections["(c) CUDA graphs"]["rows"]
    assert len(graphs) == 5 and all(r["status"] == "pass" for r in graphs)  # identical to eager
    assert all(r["case"].endswith("float32") for r in graphs)  # identity is judged in fp32
    assert "sampled (seeded)" in graphs[-1]["case"]
    attention = sections["(0) fused attention"]["rows"]
    assert len(attention) == 4 and all(r["status"] == "pass" for r in attention)  # float32 on the CPU
    long = sections["(e) long context"]["rows"]
    assert [r["status"] for r in long] == ["ok", "pass"]  # trees at long context equal plain
    speed = [r for r in sections["(b) speed tiny-a"]["rows"] if "multiguess" in r["case"]]
    assert len(speed) == 10  # plain, chain and tree for two drafts, at batch 1 and batched
    for row in speed:
        assert row["tokens_per_second"] > 0
        done, total = row["identical_to_plain"].split("/")
        assert done == total, row  # fp32 on the CPU: speculation is exact


def test_chi_square_pvalue_is_the_chi_square_survival_function() -> None:
    dist = {(a,): p for a, p in enumerate([0.5, 0.3, 0.2])}
    samples = [(0,)] * 60 + [(1,)] * 20 + [(2,)] * 20
    stat = (60 - 50) ** 2 / 50 + (20 - 30) ** 2 / 30 + (20 - 20) ** 2 / 20
    assert gpu_check.chi_square_pvalue(samples, dist) == pytest.approx(chi2.sf(stat, 2), rel=1e-9)
    assert gpu_check.chi_square_pvalue([(3,)], dist) == 0.0  # an outcome the target cannot produce


def test_versions_older_than_the_code_needs_are_named_with_the_reason() -> None:
    assert gpu_check.version_problems({"torch": "2.5.0+cu124", "transformers": "4.56.1"}) == []
    problems = gpu_check.version_problems({"torch": "2.4.1", "transformers": "4.55.0.dev0"})
    assert problems == [
        "torch 2.4.1 is older than 2.5, which scaled_dot_product_attention(enable_gqa=) and "
        "FlexAttention need",
        "transformers 4.55.0.dev0 is older than 4.56, which _from_config(dtype=) and "
        "from_pretrained(dtype=) need",
    ]


def test_the_device_boundary_check_names_the_cpu_familys_modules() -> None:
    loaded = ["multiguess.engine.engine", "multiguess.engine.backends.cpu.bf16_kernel", "torch"]
    assert gpu_check.cpu_modules(loaded) == ["multiguess.engine.backends.cpu.bf16_kernel"]
    assert gpu_check.cpu_modules(["multiguess.engine.backends.cuda.attention"]) == []


def test_a_cuda_host_without_triton_or_a_c_compiler_is_named_before_anything_runs() -> None:
    assert gpu_check.toolchain_problems("cuda", True, "/usr/bin/cc") == []
    assert gpu_check.toolchain_problems("cpu", False, None) == []  # the dry run compiles nothing
    assert gpu_check.toolchain_problems("cuda:0", False, None) == [
        "Triton is not installed; FlexAttention's CUDA kernels are compiled by it",
        "no C compiler (cc or gcc) on PATH; Triton builds its kernel launcher with one",
    ]
