"""Report the sampling-exactness test's statistics: p-values and total-variation distances.

Runs the same cases as ``tests/engine/test_sampling_exact.py`` (tiny 8-token-vocabulary models,
every 3-token continuation enumerated) and prints, per tree shape and setting, the chi-square
p-value and the total-variation distance between the empirical and the exact distribution,
plus the same for plain sampling from the draft (which must be rejected). Run from the repo
root: ``.venv/bin/python bench/sampling_exactness.py``; the JSON goes to docs/bench/ and
docs/BENCHMARKS.md is rendered again.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_docs
from multiguess import LLM, SamplingParams
from multiguess.provenance import provenance

from tests.engine import test_sampling_exact as case


def total_variation(samples: list[tuple[int, ...]], dist: dict[tuple[int, ...], float]) -> float:
    counts = Counter(samples)
    n = len(samples)
    return 0.5 * sum(abs(counts[o] / n - p) for o, p in dist.items())


def build_pair(folder: Path) -> tuple[Path, Path]:
    tokenizer = case.build_text_tokenizer(list("abcd"), pieces=[])
    target = case.save_model(folder / "target", case.model_config("llama", len(tokenizer)), 5, tokenizer)
    import torch
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(target)
        model.lm_head.weight.mul_(0.25)
        model.save_pretrained(target)
    return target, case.save_noisy_copy(target, folder / "draft", noise=1.0, seed=6)


def case_row(name: str, samples: list[tuple[int, ...]], exact: dict, mal: float | None = None) -> dict:
    return {
        "case": name,
        "samples": len(samples),
        "p_value": case.chi_square_pvalue(samples, exact),
        "total_variation": round(total_variation(samples, exact), 4),
        "mean_accepted_length": None if mal is None else round(mal, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path("docs"), help="docs folder: bench/ JSON and BENCHMARKS.md"
    )
    args = parser.parse_args()
    target, draft = build_pair(Path(tempfile.mkdtemp()))
    rows = []
    for shape, setting in case.CASES:
        k, depth = case.SHAPES[shape]
        params = SamplingParams(
            max_tokens=case.LENGTH, ignore_eos=True, n=case.SAMPLES, seed=17, **case.SETTINGS[setting]
        )
        drafter, draft_dir = ("ngram", None) if shape == "ngram" else ("model", str(draft))
        if shape == "subset":  # a draft that scores only part of the vocabulary, as in the test
            draft_dir = str(case.with_draft_vocab(draft, [1, 4, 6, 7]))
        llm = LLM(str(target), draft_dir, k, depth, dtype="float32", max_batch=256, drafter=drafter)
        out = llm.generate([case.PROMPT], params)[0]
        samples = [tuple(o.token_ids) for o in out.outputs]
        mal = sum(o.stats["mean_accepted_length"] for o in out.outputs) / len(out.outputs)
        exact = case.exact_distribution(target, params)
        rows.append(case_row(f"{shape} (k={k}, depth={depth}), {setting}", samples, exact, mal))
    params = SamplingParams(max_tokens=case.LENGTH, ignore_eos=True, n=case.SAMPLES, seed=17, temperature=1.0)
    plain_draft = LLM(str(draft), None, dtype="float32", max_batch=256)
    samples = [tuple(o.token_ids) for o in plain_draft.generate([case.PROMPT], params)[0].outputs]
    rejected = case_row(
        "the draft's own distribution (must be rejected), t1",
        samples,
        case.exact_distribution(target, params),
    )
    rows.append(rejected | {"must_reject": True})
    report = {**provenance(), "cases": rows}
    (args.out / "bench").mkdir(parents=True, exist_ok=True)
    (args.out / "bench" / bench_docs.SAMPLING_FILE).write_text(json.dumps(report, indent=2) + "\n")
    bench_docs.write(args.out)
    print("\n".join(bench_docs.sampling_section(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
