"""`multiguess bench` end to end on tiny models: every method runs and the report is written."""

import json
import sys
from pathlib import Path

import pytest
from multiguess.benchmark import MethodResult, engine_generator
from multiguess.cli import main
from multiguess.engine.config import EngineConfig
from multiguess.engine.engine import Engine
from multiguess.models.loading import load_model
from multiguess.params import SamplingParams

from tests.engine.test_eagle3 import saved_head

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_docs


def test_bench_writes_results_table_and_plot(
    tmp_path: Path, tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    out = tmp_path / "docs"
    (out).mkdir()
    (out / "BENCHMARKS.md").write_text("# Benchmarks\n\nHand-written notes are replaced.\n")
    head = saved_head(tiny_llama, tmp_path / "head", seed=3)
    argv = ["bench", "--target", str(tiny_llama), "--draft", str(tiny_llama_draft), "--dtype", "float32"]
    argv += ["--prompts", "2", "--repeats", "2", "--max-tokens", "6", "--out", str(out), "--head", str(head)]
    assert main(argv) == 0
    report = json.loads((out / "bench" / "results-float32.json").read_text())
    rows = {r["method"]: r for r in report["methods"]}
    assert set(rows) == {
        "transformers generate",
        "transformers assisted",
        "multiguess plain",
        "multiguess plain, sampled",
        "multiguess chain",
        "multiguess tree",
        "multiguess tree, sampled",
        "multiguess eagle3 tree",
        "multiguess eagle3 tree, sampled",
    }
    assert report["eagle3_head"] == str(head)
    for name in (
        "multiguess plain",
        "multiguess chain",
        "multiguess tree",
        "multiguess eagle3 tree",
        "transformers assisted",
    ):
        assert rows[name]["identical_to_generate"] == 1.0, name
        assert rows[name]["identical_to_plain"] == 1.0, name
        assert len(rows[name]["repeats"]) == 2
    for name in ("multiguess tree", "multiguess eagle3 tree"):
        row = rows[name]
        assert row["mean_accepted_length"] >= 1.0
        # Depth 1 is verified at every drafted step; deeper levels only where a tree reached them.
        assert 1 <= len(row["acceptance_by_depth"]) <= 4
        assert all(0.0 <= a <= 1.0 for a in row["acceptance_by_depth"])
        # Measured (present), but a timing: under load the fitted slope can be 0 (CostMeter).
        assert row["draft_ms_per_level"] >= 0
    # The step and its bound come from the same rounds: the ratio is theirs (medians of pairs).
    bound = report["bandwidth_bound_step_ms"]
    assert report["step_over_bound"] > 0
    assert bound == pytest.approx(
        report["weight_bytes"] / report["bandwidth_gb_s"] / 1e6, rel=0.01, abs=0.006
    )
    # The command writes results only; the docs tooling (bench/bench_docs.py) renders the page
    # from the JSON alone: the run's commit and rows, nothing typed by hand.
    assert "Hand-written" in (out / "BENCHMARKS.md").read_text()
    bench_docs.write(out)
    doc = (out / "BENCHMARKS.md").read_text()
    assert "Hand-written" not in doc and "| multiguess tree |" in doc
    assert f"Commit `{report['commit']}`" in doc and "## Engine, float32" in doc
    assert (out / "img" / "bench-float32.png").stat().st_size > 1000


def test_the_engine_methods_decode_every_request_fresh(tiny_llama: Path) -> None:
    """Repeats run the same prompts: each request is its own cache scope, so none reuses an
    earlier one's prompt KV (or copies its reply) and every repeat measures a fresh prompt."""
    engine = Engine(load_model(str(tiny_llama), dtype="float32"), None, EngineConfig(max_model_len=128))
    requests = []
    add = engine.add_request

    def recorded(*args: object, **kwargs: object) -> object:
        requests.append(add(*args, **kwargs))
        return requests[-1]

    engine.add_request = recorded
    run = engine_generator(engine, 6, MethodResult("multiguess plain"))
    prompt = list(range(3, 60))
    assert run(prompt) == run(prompt)
    assert [seq.cached_tokens for seq in requests] == [0, 0]
    for name in ("first", "second"):  # the same prompt without scopes of its own: cached
        engine.add_request(name, prompt, SamplingParams(max_tokens=6))
        while engine.has_unfinished():
            engine.step()
    assert requests[-1].cached_tokens > 0
