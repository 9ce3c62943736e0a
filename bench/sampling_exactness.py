"""Report the sampling-exactness test's statistics: p-values and total-variation distances.

Runs the cases of ``tests/engine/test_sampling_exact.py`` on its engines (tiny 8-token-vocabulary
models, every 3-token continuation enumerated; fixed trees, seeded where the case is) and
prints, per case, the chi-square p-value and the total-variation distance between the
empirical and the exact distribution, plus the same for plain sampling from the draft (which
must be rejected). ``--samples`` raises the test's 3000 per case, for the power to see smaller
biases; ``--shapes`` runs some shapes only. Run from the repo root:
``.venv/bin/python bench/sampling_exactness.py``; the JSON goes to docs/bench/ and
docs/BENCHMARKS.md is rendered again.
"""

from __future__ import annotations

import argparse
import json
import random
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
    parser.add_argument(
        "--samples",
        type=int,
        default=case.SAMPLES,
        help="samples per case (more: power to see smaller biases)",
    )
    parser.add_argument("--shapes", help="comma-separated tree shapes to run (default: every case's)")
    args = parser.parse_args()
    target, draft = case.build_pair(Path(tempfile.mkdtemp()))
    shapes = set(args.shapes.split(",")) if args.shapes else set(case.SHAPES)
    rows = []
    for shape, setting, seeded in case.CASES:
        if shape not in shapes:
            continue
        k, depth = case.SHAPES[shape]
        random.seed(f"{shape}/{setting}/{seeded}")  # an unseeded request's streams: reproducible
        params = SamplingParams(
            max_tokens=case.LENGTH,
            ignore_eos=True,
            n=args.samples,
            seed=17 if seeded else None,
            **case.SETTINGS[setting],
        )
        out = case.speculative(target, draft, shape).generate([case.PROMPT], params)[0]
        samples = [tuple(o.token_ids) for o in out.outputs]
        mal = sum(o.stats["mean_accepted_length"] for o in out.outputs) / len(out.outputs)
        exact = case.exact_distribution(target, params)
        name = f"{shape} (k={k}, depth={depth}), {setting}{', seeded' if seeded else ''}"
        rows.append(case_row(name, samples, exact, mal))
    params = SamplingParams(max_tokens=case.LENGTH, ignore_eos=True, n=args.samples, seed=17, temperature=1.0)
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
