"""bench/llama_cpp.py's pure parts: the build key, llama-server's command and timings, the skip.

Nothing here builds llama.cpp or starts a server: the benchmark does that, under its own command.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bench_docs  # noqa: E402
import llama_cpp_build  # noqa: E402
import llama_cpp_server  # noqa: E402

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni
bogomips\t: 4890.81

processor\t: 1
flags\t\t: fpu sse2 avx2
"""


def bench_script() -> object:
    """bench/llama_cpp.py under another name (``llama_cpp`` is llama-cpp-python's package)."""
    spec = importlib.util.spec_from_file_location("llama_cpp_bench", ROOT / "bench" / "llama_cpp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_flags_are_the_first_cpus_sorted() -> None:
    assert llama_cpp_build.cpu_flags(CPUINFO) == ["avx2", "avx512_vnni", "avx512f", "fpu", "sse2"]
    assert llama_cpp_build.cpu_flags("Features\t: fp asimd sve\n") == ["asimd", "fp", "sve"]
    assert llama_cpp_build.cpu_flags("") == []


def test_build_key_changes_with_version_and_flags_only() -> None:
    key = llama_cpp_build.build_key("0.3.36", "x86_64", ["avx2", "avx512f"])
    assert key.startswith("0.3.36-") and key == llama_cpp_build.build_key(
        "0.3.36", "x86_64", ["avx2", "avx512f"]
    )
    assert key != llama_cpp_build.build_key("0.3.36", "x86_64", ["avx2"])
    assert key != llama_cpp_build.build_key("0.3.37", "x86_64", ["avx2", "avx512f"])


def test_configure_builds_a_static_native_server_without_network_assets() -> None:
    command = llama_cpp_build.cmake_command(Path("/src"), Path("/build"), "Ninja")
    assert command[:7] == ["cmake", "-S", "/src", "-B", "/build", "-G", "Ninja"]
    for option in ("-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"):
        assert option in command
    assert "-G" not in llama_cpp_build.cmake_command(Path("/src"), Path("/build"), None)


def test_plain_server_command_has_no_draft() -> None:
    config = llama_cpp_server.ServerConfig(Path("/m/target.gguf"), threads=2)
    command = llama_cpp_server.server_command(Path("/bin/llama-server"), config, 8123)
    assert command[:3] == ["/bin/llama-server", "-m", "/m/target.gguf"]
    assert command[command.index("-t") + 1] == "2" and command[command.index("--port") + 1] == "8123"
    assert "-md" not in command and "--spec-type" not in command


def test_extra_flags_reach_every_server_command() -> None:
    for draft in (None, Path("/m/d.gguf")):
        config = llama_cpp_server.ServerConfig(Path("/m/t.gguf"), 2, draft, extra=("--no-repack",))
        assert llama_cpp_server.server_command(Path("llama-server"), config, 1)[-1] == "--no-repack"


def test_speculative_server_command_names_the_draft_its_threads_and_length() -> None:
    config = llama_cpp_server.ServerConfig(Path("/m/t.gguf"), threads=3, draft=Path("/m/d.gguf"), draft_max=5)
    command = llama_cpp_server.server_command(Path("llama-server"), config, 1)
    assert command[command.index("-md") + 1] == "/m/d.gguf"
    assert command[command.index("-td") + 1] == "3"
    assert command[command.index("--spec-draft-n-max") + 1] == "5"
    assert command[command.index("--spec-type") + 1] == "draft-simple"


def test_completion_request_is_greedy_on_token_ids_without_prompt_cache() -> None:
    body = llama_cpp_server.completion_request([1, 2, 3], 96)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 96
    assert body["temperature"] == 0.0 and body["cache_prompt"] is False and body["return_tokens"] is True


def test_timings_parse_with_and_without_draft_counts() -> None:
    plain = {
        "timings": {
            "cache_n": 0,
            "prompt_n": 40,
            "prompt_ms": 120.5,
            "prompt_per_token_ms": 3.0,
            "prompt_per_second": 331.9,
            "predicted_n": 96,
            "predicted_ms": 1600.0,
            "predicted_per_token_ms": 16.7,
            "predicted_per_second": 60.0,
        }
    }
    timings = llama_cpp_server.parse_timings(plain)
    assert (timings.prompt_tokens, timings.predicted_tokens, timings.drafted, timings.accepted) == (
        40,
        96,
        0,
        0,
    )
    assert timings.decode_tokens_per_second == pytest.approx(60.0)
    plain["timings"] |= {"draft_n": 120, "draft_n_accepted": 70}
    drafted = llama_cpp_server.parse_timings(plain)
    assert (drafted.drafted, drafted.accepted) == (120, 70)


def test_without_a_compiler_the_benchmark_skips_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MULTIGUESS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert bench_script().main(["--out", str(tmp_path / "docs")]) == 0
    assert "skipped: no C compiler on PATH" in capsys.readouterr().err
    assert not (tmp_path / "docs").exists()


def test_section_names_the_run_its_command_and_every_method() -> None:
    def row(method: str, tps: float, **extra: float) -> dict:
        ratios = {"vs multiguess plain, bf16": tps / 50, "vs llama.cpp plain, Q4_1": tps / 60}
        return {"method": method, "tokens_per_second": tps, **ratios, **extra}

    report = {
        "commit": "abc1234",
        "date": "2026-01-01 00:00 UTC",
        "machine": "a CPU, 2 cores",
        "llama_cpp_python": "0.3.36",
        "threads": 2,
        "repeats": 2,
        "max_tokens": 64,
        "prompts": 4,
        "draft_max": 4,
        "methods": [
            row("llama.cpp plain, Q4_1", 60.0, server_decode_tokens_per_second=70.0),
            row("multiguess tree, bf16", 55.0, identical_to_own_plain=1.0, mean_accepted_length=2.1),
        ],
    }
    lines = bench_docs.llama_cpp_section(report)
    text = "\n".join(lines)
    assert "Reproduce: `.venv/bin/python bench/llama_cpp.py --prompts 4 --repeats 2 --max-tokens 64`" in text
    assert "| llama.cpp plain, Q4_1 | 60.0 | 1.20 | 1.00 |  |  | 70.0 |" in text
    assert "| multiguess tree, bf16 | 55.0 | 1.10 | 0.92 | 4/4 | 2.10 |  |" in text
    assert bench_docs.llama_cpp_section(None)[2].startswith("No result recorded yet")
