"""Under sampling, speculation keeps the target's output distribution exactly.

A tiny model over an 8-token vocabulary makes the exact distribution of every 3-token
continuation computable by enumeration (8^3 outcomes). Thousands of samples drawn through the
engine, for several tree shapes and sampling settings, are tested against it with a
chi-square test; the same test must reject samples of the *draft's* distribution, which proves
it has the power to catch a wrong sampler.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from multiguess import LLM, SamplingParams
from multiguess.engine.penalties import adjusted_logits
from multiguess.engine.sampling import Processing, processed_probs
from multiguess.engine.tree import TokenTree
from multiguess.params import StructuredOutputsParams
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from tests.engine.test_draft_vocab import with_draft_vocab
from tests.tiny_models import build_text_tokenizer, model_config, save_model, save_noisy_copy

LENGTH = 3
SAMPLES = 3000
PROMPT = [5, 6, 7, 4]
ALPHA = 1e-3  # a correct sampler fails a case for one seed of its draws in a thousand


@pytest.fixture(autouse=True)
def reproducible_draws(request: pytest.FixtureRequest) -> None:
    """An unseeded request's random streams are seeded from ``random``: seeded here by the
    test's name, so every run of a case draws the same samples and a failure reproduces."""
    random.seed(request.node.nodeid)


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_pair(tmp_path_factory.mktemp("small-vocab"))


def build_pair(folder: Path) -> tuple[Path, Path]:
    """The target and its noisy draft under ``folder``; ``bench/sampling_exactness.py`` builds
    the same pair."""
    tokenizer = build_text_tokenizer(list("abcd"), pieces=[])  # text tokens, so grammars apply
    config = model_config("llama", len(tokenizer))
    target = save_model(folder / "target", config, seed=5, tokenizer=tokenizer)
    with torch.no_grad():  # a flatter target than the default: many outcomes carry mass
        model = AutoModelForCausalLM.from_pretrained(target)
        model.lm_head.weight.mul_(0.25)
        model.save_pretrained(target)
    return target, save_noisy_copy(target, folder / "draft", noise=1.0, seed=6)


def exact_distribution(
    model_dir: Path,
    params: SamplingParams,
    allowed: Callable[[tuple[int, ...]], set[int]] | None = None,
) -> dict[tuple[int, ...], float]:
    """P(x1..xL | prompt) by enumeration, with the request's penalties and processing at every
    step (each prefix as plain decoding sees it); ``allowed`` maps a prefix to the tokens a
    grammar lets follow it (the others go to -inf before processing)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    vocab = model.config.vocab_size
    dist: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(LENGTH):
        prefixes = list(dist)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1]
        logits = torch.cat(
            [
                adjusted_logits(row[None], TokenTree.chain([0]), params, PROMPT, list(p), frozenset())
                for row, p in zip(logits, prefixes, strict=True)
            ]
        )
        if allowed is not None:
            for i, p in enumerate(prefixes):
                barred = [x for x in range(vocab) if x not in allowed(p)]
                logits[i, barred] = float("-inf")
        probs = processed_probs(
            logits, [Processing(params.temperature, params.top_p, params.top_k)] * len(logits)
        )
        dist = {
            (*p, x): dist[p] * probs[i, x].item()
            for i, p in enumerate(prefixes)
            for x in range(vocab)
            if probs[i, x] > 0
        }
    return dist


def chi_square_pvalue(samples: list[tuple[int, ...]], dist: dict[tuple[int, ...], float]) -> float:
    """Goodness of fit; outcomes expected fewer than 5 times are pooled into one bin."""
    counts = Counter(samples)
    assert set(counts) <= set(dist), "sampled an outcome the target cannot produce"
    n = len(samples)
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for outcome, p in dist.items():
        if p * n >= 5:
            observed.append(counts[outcome])
            expected.append(p * n)
        else:
            pooled_obs += counts[outcome]
            pooled_exp += p * n
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    return float(chisquare(observed, expected).pvalue)


def draw(llm: LLM, params: SamplingParams) -> list[tuple[int, ...]]:
    out = llm.generate([PROMPT], params)[0]
    return [tuple(o.token_ids) for o in out.outputs]


SETTINGS = {
    "t1": dict(temperature=1.0),
    "t0.6-topk5": dict(temperature=0.6, top_k=5),
    "t1.3-topp0.8": dict(temperature=1.3, top_p=0.8),
    "t1-penalized": dict(
        temperature=1.0,
        presence_penalty=0.7,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
        logit_bias={5: 1.0},
    ),
}
# (num_candidates, depth); "wide" offers every token of the vocabulary as a child; "bushy"
# draws 20 nodes and keeps 16, so the budget chooses among drawn children; "subset" drafts over
# a draft vocabulary of half the tokens (q is zero on the others).
SHAPES = {
    "chain": (1, 2),
    "wide": (8, 1),
    "tree": (3, 2),
    "bushy": (4, 2),
    "ngram": (3, 2),
    "subset": (3, 2),
    "suffix": (1, 1),
}
# Unseeded samples go through multi-draft speculative sampling; seeded ones draw each token
# with a uniform fixed by seed and position and are verified like greedy output.
CASES = [(shape, "t1", False) for shape in ("chain", "wide", "tree", "bushy", "subset")] + [
    ("tree", "t0.6-topk5", False),
    ("tree", "t1.3-topp0.8", False),
    ("bushy", "t1-penalized", False),  # every node's counts include its ancestors' tokens
    ("ngram", "t1", False),  # deterministic children: q is a point mass
    ("suffix", "t1", False),  # copy drafts from the prompt and earlier samples' outputs
    ("suffix", "t1-penalized", True),
    ("chain", "t1", True),
    ("bushy", "t1.3-topp0.8", True),
    ("tree", "t1-penalized", True),
]


@pytest.mark.parametrize(("shape", "setting", "seeded"), CASES)
def test_speculative_sampling_matches_the_target_exactly(
    small_vocab_pair: tuple[Path, Path], shape: str, setting: str, seeded: bool
) -> None:
    check_exact(small_vocab_pair, shape, setting, seeded, batched=False)


# Unseeded samples through the batched acceptance devices run (``engine/batch_acceptance.py``):
# sampled children with truncation, a draft vocabulary (q zero off it) and deterministic
# children. Seeded ones give the walks' tokens (tests/engine/test_batch_acceptance.py).
BATCHED_CASES = [
    ("bushy", "t1.3-topp0.8", False),
    ("subset", "t0.6-topk5", False),
    ("ngram", "t1-penalized", False),
]


@pytest.mark.parametrize(("shape", "setting", "seeded"), BATCHED_CASES)
def test_batched_acceptance_matches_the_target_exactly(
    small_vocab_pair: tuple[Path, Path], shape: str, setting: str, seeded: bool
) -> None:
    check_exact(small_vocab_pair, shape, setting, seeded, batched=True)


def check_exact(pair: tuple[Path, Path], shape: str, setting: str, seeded: bool, batched: bool) -> None:
    target, draft = pair
    seed = 17 if seeded else None
    params = SamplingParams(max_tokens=LENGTH, ignore_eos=True, n=SAMPLES, seed=seed, **SETTINGS[setting])
    llm = speculative(target, draft, shape)
    llm.engine.target.backend.batched_acceptance = batched  # type: ignore[misc]
    samples = draw(llm, params)
    pvalue = chi_square_pvalue(samples, exact_distribution(target, params))
    assert llm.engine.totals.draft_tokens > 0  # speculation was verified, not skipped
    assert len(samples) == SAMPLES
    assert pvalue > ALPHA, f"{shape}/{setting}: p = {pvalue:.2e}"


def speculative(target: Path, draft: Path, shape: str) -> LLM:
    """The engine drafting the named shape. Fixed trees: each case verifies the shape it names,
    not what the adaptive policy would pick."""
    num_candidates, depth = SHAPES[shape]
    drafter, draft_dir = (shape, None) if shape in ("ngram", "suffix") else ("model", str(draft))
    if shape == "subset":
        draft_dir = str(with_draft_vocab(draft, [1, 4, 6, 7]))
    return LLM(
        str(target),
        draft_dir,
        num_candidates,
        depth,
        dtype="float32",
        max_batch=256,
        drafter=drafter,
        adaptive=False,
    )


# Tokens 4..7 are a, b, c, d. The regex's second token depends on its first, so each tree
# node must be masked by the grammar advanced along its own path; it is complete after three.
GRAMMAR = StructuredOutputsParams(regex="(a[bc]|b[ad]|cd|dc)[a-d]")
SECOND = {4: {5, 6}, 5: {4, 7}, 6: {7}, 7: {6}}


def grammar_allows(prefix: tuple[int, ...]) -> set[int]:
    return SECOND[prefix[0]] if len(prefix) == 1 else {4, 5, 6, 7}


@pytest.mark.parametrize(
    ("shape", "setting", "seeded"),
    [
        ("chain", "t1", False),
        ("bushy", "t1-penalized", False),
        ("subset", "t1", False),
        ("ngram", "t1", False),
        ("tree", "t1.3-topp0.8", True),
    ],
)
def test_constrained_speculative_sampling_matches_the_masked_target_exactly(
    small_vocab_pair: tuple[Path, Path], shape: str, setting: str, seeded: bool
) -> None:
    """Structured output: the target's distribution masked by the grammar at every node, and
    the draft's proposals masked the same way, keep sampling exact."""
    target, draft = small_vocab_pair
    seed = 23 if seeded else None
    params = SamplingParams(
        max_tokens=LENGTH, n=SAMPLES, seed=seed, structured_outputs=GRAMMAR, **SETTINGS[setting]
    )
    llm = speculative(target, draft, shape)
    samples = draw(llm, params)
    exact = exact_distribution(target, params, grammar_allows)
    pvalue = chi_square_pvalue(samples, exact)
    assert llm.engine.totals.draft_tokens > 0
    assert len(samples) == SAMPLES
    assert pvalue > ALPHA, f"{shape}/{setting}: p = {pvalue:.2e}"


def test_the_test_rejects_the_draft_distribution(small_vocab_pair: tuple[Path, Path]) -> None:
    target, draft = small_vocab_pair
    params = SamplingParams(max_tokens=LENGTH, ignore_eos=True, n=SAMPLES, seed=17, temperature=1.0)
    plain_draft = LLM(str(draft), None, dtype="float32", max_batch=256)
    pvalue = chi_square_pvalue(draw(plain_draft, params), exact_distribution(target, params))
    assert pvalue < 1e-6


def test_seed_reproduces_and_n_samples_differ(small_vocab_pair: tuple[Path, Path]) -> None:
    target, draft = small_vocab_pair
    llm = LLM(str(target), str(draft), 3, 2, dtype="float32")
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, n=4, seed=3)
    first, second = draw(llm, params), draw(llm, params)
    assert first == second
    assert len(set(first)) > 1


def test_temperature_zero_is_greedy(small_vocab_pair: tuple[Path, Path]) -> None:
    target, draft = small_vocab_pair
    spec = LLM(str(target), str(draft), 3, 2, dtype="float32")
    plain = LLM(str(target), None, dtype="float32")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert spec.generate([PROMPT], params)[0].token_ids == plain.generate([PROMPT], params)[0].token_ids
