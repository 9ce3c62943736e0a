"""The speed benchmark: every decoding method on the same prompts, models, dtype and threads.

One run measures, in turn and interleaved over repeats so machine noise hits all alike:
(1) transformers ``generate`` (plain greedy), (2) transformers assisted generation with the
same draft, (3) multiguess plain (no draft), (4) multiguess chain (``num_candidates=1``) and
(5) multiguess tree (the defaults), plain and tree also sampled (seeded), and (6) the same tree
drafted by an EAGLE-3 head when one is given. Ratios are taken within the run; tokens/s are medians over
repeats; speculative methods also report acceptance by tree depth and the draft's time per
level against a plain target step. It also measures memory bandwidth and the target's verification cost by tree size,
which bound what speculation can gain on the machine.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from multiguess.engine.engine import Engine
from multiguess.engine.loaded_model import LoadedModel
from multiguess.engine.runner import NativeRunner
from multiguess.engine.tree import TokenTree
from multiguess.params import SamplingParams

METHODS = (
    "transformers generate",
    "transformers assisted",
    "multiguess plain",
    "multiguess plain, sampled",
    "multiguess chain",
    "multiguess tree",
    "multiguess tree, sampled",
    "multiguess eagle3 tree",
    "multiguess eagle3 tree, sampled",
)


def load_prompts() -> tuple[int, list[dict[str, str]]]:
    data = json.loads(resources.files("multiguess.data").joinpath("bench_prompts.json").read_text())
    return data["version"], data["prompts"]


@dataclass
class MethodResult:
    name: str
    sampled: bool = False  # sampled outputs are not expected to equal greedy ones
    tokens_per_second: list[float] = field(default_factory=list)  # one per repeat
    outputs: list[list[int]] = field(default_factory=list)  # first repeat, per prompt
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    level_verified: list[int] = field(default_factory=list)  # per tree depth (index 0: depth 1)
    level_accepted: list[int] = field(default_factory=list)
    draft_ms_per_level: list[float] = field(default_factory=list)  # per prompt, the engine's running value

    def record_levels(self, outcomes: list[tuple[int, int | None]]) -> None:
        """One verification's levels in depth order: (children, accepted child's rank or None)."""
        for depth, (_, rank) in enumerate(outcomes):
            if depth == len(self.level_verified):
                self.level_verified.append(0)
                self.level_accepted.append(0)
            self.level_verified[depth] += 1
            self.level_accepted[depth] += rank is not None

    @property
    def median_tps(self) -> float:
        return statistics.median(self.tokens_per_second)

    def identical_fraction(self, other: MethodResult) -> float:
        same = sum(a == b for a, b in zip(self.outputs, other.outputs, strict=True))
        return round(same / len(other.outputs), 3)

    def as_dict(
        self, reference: MethodResult | None, assisted: MethodResult | None, plain: MethodResult | None = None
    ) -> dict:
        """One table row; ``plain`` (multiguess without a draft) shows speculation is lossless
        against the engine's own decoding, which is exact even where dtypes round differently
        from transformers."""
        row: dict = {"method": self.name, "tokens_per_second": round(self.median_tps, 2)}
        row["repeats"] = [round(t, 2) for t in self.tokens_per_second]
        if reference is not None:
            row["speedup_vs_generate"] = round(self.median_tps / reference.median_tps, 3)
            if not self.sampled:
                row["identical_to_generate"] = self.identical_fraction(reference)
        if plain is not None and not self.sampled:
            row["identical_to_plain"] = self.identical_fraction(plain)
        if assisted is not None:
            row["speedup_vs_assisted"] = round(self.median_tps / assisted.median_tps, 3)
        if self.draft_tokens:
            row["mean_accepted_length"] = round(1 + self.accepted_tokens / self.verify_steps, 3)
            row["acceptance_rate"] = round(self.accepted_tokens / max(1, self.draft_tokens), 3)
            row["acceptance_by_depth"] = [
                round(a / v, 3) for a, v in zip(self.level_accepted, self.level_verified, strict=True)
            ]
        if self.draft_ms_per_level:
            row["draft_ms_per_level"] = round(statistics.median(self.draft_ms_per_level), 3)
        return row


Generator = Callable[[list[int]], list[int]]


def hf_generator(target: LoadedModel, max_tokens: int, assistant: LoadedModel | None = None) -> Generator:
    model = target.model
    extra = {"assistant_model": assistant.model} if assistant is not None else {}

    def run(prompt: list[int]) -> list[int]:
        with torch.inference_mode():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, **extra)
        return ids[0, len(prompt) :].tolist()

    return run


def engine_generator(
    engine: Engine, max_tokens: int, result: MethodResult, temperature: float = 0.0
) -> Generator:
    """Each call one request decoded fresh, in a cache scope of its own (``cache_salt``), as
    transformers' ``generate`` keeps nothing between calls: no request reuses an earlier one's
    prompt KV or copies its reply (the recent-output index), which repeats of the same prompts
    would otherwise turn into speed that no new prompt gets."""
    requests = itertools.count()

    def run(prompt: list[int]) -> list[int]:
        salt = f"bench-{next(requests)}"
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0, cache_salt=salt)
        seq = engine.add_request("bench", prompt, params)
        while engine.has_unfinished():
            engine.step()
            for outcomes in engine.last_outcomes:
                result.record_levels(outcomes)
        if engine.planner.costs.draft_per_level is not None:
            result.draft_ms_per_level.append(engine.planner.costs.draft_per_level * 1000)
        result.verify_steps += seq.stats.verify_steps
        result.draft_tokens += seq.stats.draft_tokens
        result.accepted_tokens += seq.stats.accepted_tokens
        return seq.output_ids

    return run


def measure_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Read bandwidth in GB/s: a large float32 tensor summed (read once) per repeat."""
    data = torch.ones(megabytes * 1024 * 1024 // 4)
    data.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(times) / 1e9


@dataclass(frozen=True)
class StepBound:
    """A plain decode step against the time to read every weight once, medians of paired rounds."""

    step_ms: float
    bandwidth_gb_s: float
    bound_ms: float
    ratio: float  # step over bound, the median of the rounds' own ratios


def step_against_bound(
    engine: Engine, prompt: list[int], weights: int, rounds: int = 5, steps: int = 32
) -> StepBound:
    """Time plain decode steps (prefill left out) right after each bandwidth probe, ``rounds``
    times. A shared machine's bandwidth drifts within the hour (docs/ENGINE.md), so a bound
    probed minutes away from the steps it is compared with says little about them."""
    step, bandwidth, bound, ratio = [], [], [], []
    for _ in range(rounds):
        probed = measure_bandwidth(repeats=3)
        engine.add_request("bound", prompt, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
        engine.step()  # the prefill and the first token
        start, count = time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            count += 1
        step.append((time.perf_counter() - start) / count * 1000)
        bandwidth.append(probed)
        bound.append(weights / (probed * 1e9) * 1000)
        ratio.append(step[-1] / bound[-1])
    median = statistics.median
    return StepBound(
        round(median(step), 2), round(median(bandwidth), 2), round(median(bound), 2), round(median(ratio), 2)
    )


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes read per decode step: every parameter and buffer once (tied embeddings counted
    once; quantized weights are buffers of blocks)."""
    seen, total = set(), 0
    for p in [*model.parameters(), *model.buffers()]:
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def weights_of(model: torch.nn.Module) -> str:
    """The format most of a model's linears hold their weights in: a GGUF block format
    (``Q4_1``), else the float dtype's name."""
    from multiguess.engine.quantized import linear_formats

    kinds = linear_formats(model)
    if kinds:
        return kinds.most_common(1)[0][0].upper()
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def verify_cost(target: LoadedModel, sizes: tuple[int, ...], prompt: list[int], repeats: int = 5) -> dict:
    """Median ms of one target forward over ``T`` tree nodes after ``prompt``."""
    prefix = len(prompt)
    runner = NativeRunner(target, 1, prefix + max(sizes) + 1)
    runner.forward_trees([0], [0], [TokenTree.chain(prompt)], last_only=True)
    costs = {}
    for size in sizes:
        tree = TokenTree.chain([prompt[-1]] * size)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            runner.forward_trees([0], [prefix], [tree])
            times.append(time.perf_counter() - start)
        costs[size] = round(statistics.median(times) * 1000, 2)
    return costs


def run_methods(
    methods: dict[str, tuple[Generator, MethodResult]],
    prompts: list[list[int]],
    repeats: int,
    progress: Callable[[str], None],
) -> None:
    """Each repeat runs every method over every prompt; methods alternate per prompt."""
    for repeat in range(repeats):
        elapsed = {name: 0.0 for name in methods}
        produced = {name: 0 for name in methods}
        for i, prompt in enumerate(prompts):
            for name, (generate, result) in methods.items():
                start = time.perf_counter()
                out = generate(prompt)
                elapsed[name] += time.perf_counter() - start
                produced[name] += len(out)
                if repeat == 0:
                    result.outputs.append(out)
                progress(f"repeat {repeat + 1}/{repeats} prompt {i + 1}/{len(prompts)} {name}")
        for name, (_, result) in methods.items():
            result.tokens_per_second.append(produced[name] / elapsed[name])


def markdown_report(report: dict) -> str:
    rows = report["methods"]
    lines = [
        "| method | tokens/s (median) | × generate | × assisted | mean accepted length | acceptance "
        "| identical to generate | identical to multiguess plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['tokens_per_second']} | {r.get('speedup_vs_generate', '')} | "
            f"{r.get('speedup_vs_assisted', '')} | {r.get('mean_accepted_length', '')} | "
            f"{r.get('acceptance_rate', '')} | {r.get('identical_to_generate', '')} | "
            f"{r.get('identical_to_plain', '')} |"
        )
    return "\n".join(lines)


def plot_report(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["method"] for r in report["methods"]]
    values = [r["tokens_per_second"] for r in report["methods"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.barh(names, values, color="tab:blue")
    left.set_xlabel("tokens/s (median over repeats)")
    left.set_title("Decoding speed, same prompts and models")
    costs = report["verify_cost_ms"]
    for dtype, series in costs.items():
        right.plot([int(k) for k in series], list(series.values()), marker="o", label=dtype)
    right.set_xlabel("tree nodes verified in one forward")
    right.set_ylabel("ms per target forward")
    right.set_title("Verification cost by tree size")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
