"""The batched acceptance rules (``acceptance.accepted_paths``, ``acceptance.accept_sampled_rows``,
``sampling.raced_rows``) against the node-by-node walks they replace on devices, and the
engine's use of them: the same greedy and seeded tokens, the target's distribution for
unseeded samples, and a step's host<->device transfers held to a constant."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from multiguess import SamplingParams
from multiguess.engine.acceptance import accept_greedy, accept_sampled_rows, accepted_paths
from multiguess.engine.batch_acceptance import child_table
from multiguess.engine.config import EngineConfig
from multiguess.engine.drafters.model import ModelDrafter
from multiguess.engine.engine import Engine
from multiguess.engine.sampling import (
    Processing,
    RowSettings,
    draw_without_replacement,
    key_noise,
    processed_rows,
    raced_rows,
    scored_choice,
    settings_table,
    sorted_processed_probs,
)
from multiguess.engine.tree import TokenTree
from multiguess.models.loading import load_model
from scipy.stats import chisquare

from tests.engine.test_lossless import random_prompts
from tests.transfers import TransferCounter


def random_tree(rng: random.Random, size: int, vocab: int) -> TokenTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, size)]
    return TokenTree(tuple(rng.randrange(vocab) for _ in range(size)), tuple(parents))


def padded(trees: list[TokenTree]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(t) for t in trees)
    tokens = torch.tensor([(*t.tokens, *(-1,) * (width - len(t))) for t in trees])
    parents = torch.tensor([(*t.parents, *(0,) * (width - len(t))) for t in trees])
    return tokens, parents


def test_batched_greedy_paths_are_the_walks() -> None:
    """Random trees over a 3-token vocabulary: siblings share tokens (the first matching child
    wins) and most nodes match their parent's choice."""
    rng = random.Random(0)
    for _ in range(20):
        trees = [random_tree(rng, rng.randrange(1, 12), 3) for _ in range(5)]
        tokens, parents = padded(trees)
        choice = torch.randint(0, 3, tokens.shape, generator=torch.Generator().manual_seed(rng.randrange(99)))
        depth = max(t.max_depth for t in trees)
        path, lengths = accepted_paths(tokens, parents, choice, depth)
        for b, tree in enumerate(trees):
            walk = accept_greedy(tree, choice[b].tolist())
            n = int(lengths[b])
            assert path[b, :n].tolist() == walk.path
            assert choice[b, path[b, :n]].tolist() == walk.tokens


@pytest.mark.parametrize(
    "processing", [Processing(1.0), Processing(0.8, top_p=0.9), Processing(1.3, top_k=3)]
)
def test_batched_races_are_the_seeded_races(processing: Processing) -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)) * 3
    keys = torch.tensor([11, -5, 2**62, 7, 7, 0])
    settings = RowSettings.of(settings_table([processing] * 6, 50), processing.truncates(50))
    got = raced_rows(logits, settings, keys).tolist()
    if processing.truncates(50):
        probs = sorted_processed_probs(logits, [processing] * 6)
        expected = (probs / key_noise(keys.tolist(), torch.arange(50))).argmax(-1).tolist()
    else:
        expected = [scored_choice(logits[i], processing.temperature, int(keys[i])) for i in range(6)]
    assert got == expected
    assert torch.allclose(processed_rows(logits, settings), sorted_processed_probs(logits, [processing] * 6))


def sampled_outcomes(
    draft: torch.Tensor, target: torch.Tensor, tries: int, count: int, deterministic: bool
) -> list[tuple[int, ...]]:
    """``count`` batched acceptances of a two-level tree drawn afresh for each row: ``tries``
    children of the root drawn from ``draft[0]`` without replacement (or its ``tries`` most
    likely tokens, a deterministic draft), one child under each drawn from ``draft[1]``."""
    vocab = target.shape[-1]
    generator = torch.Generator().manual_seed(5)
    trees, index = [], torch.full((count, 2 * tries + 1), -1)
    rows = [draft[0], draft[1]]
    for b in range(count):
        if deterministic:
            first = draft[0].topk(tries).indices.tolist()
        else:
            first = draw_without_replacement(draft[0], tries, generator)
            index[b, 0] = 0
        second = [draw_without_replacement(draft[1], 1, generator)[0] for _ in first]
        tokens = (0, *first, *second)
        parents = (-1, *(0,) * len(first), *range(1, 1 + len(first)))
        trees.append(TokenTree(tokens, parents))
        index[b, 1 : 1 + len(first)] = 1
    tokens, _ = padded(trees)
    width = tokens.shape[1]
    children = torch.tensor([child_table(t, width, tries) for t in trees])
    node_logits = torch.log(target)[None].expand(count, width, vocab)  # every node: the same target row
    settings = RowSettings.of(settings_table([Processing(1.0)] * count, vocab), False)
    uniforms = torch.rand(count, 3, tries + 1, generator=generator, dtype=torch.float64)
    path, lengths, bonus = accept_sampled_rows(
        node_logits, tokens, children, torch.stack(rows), index[:, :width], settings, uniforms
    )
    out = []
    for b in range(count):
        n = int(lengths[b])
        out.append((*tokens[b, path[b, 1:n]].tolist(), int(bonus[b])))
    return out


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled", "deterministic"])
def test_batched_sampling_keeps_the_target_distribution(deterministic: bool) -> None:
    """Whatever the draft, the first emitted token follows the target, and so does the second
    wherever the first was accepted (each node's target row is the same distribution here, and
    what follows an accepted node depends only on that node)."""
    target = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.2], dtype=torch.float64)
    draft = torch.tensor([[0.3, 0.1, 0.3, 0.1, 0.2], [0.1, 0.5, 0.1, 0.2, 0.1]], dtype=torch.float64)
    outcomes = sampled_outcomes(draft, target, 2, 6000, deterministic)
    firsts = [o[0] for o in outcomes]
    seconds = [o[1] for o in outcomes if len(o) >= 2]
    assert len(seconds) > 500
    for drawn in (firsts, seconds):
        counts = [drawn.count(x) for x in range(5)]
        assert chisquare(counts, (target * len(drawn)).tolist()).pvalue > 1e-3


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    seqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [s.output_ids for s in seqs]


SEEDED = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, top_p=0.95, seed=7)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=16, ignore_eos=True),
        SEEDED,
        SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.2, seed=3, presence_penalty=0.5),
    ],
    ids=["greedy", "seeded", "penalized"],
)
def test_batched_acceptance_gives_the_walks_tokens(
    tiny_llama: Path, tiny_llama_draft: Path, params: SamplingParams
) -> None:
    prompts = random_prompts(31, (4, 13, 7))
    config = EngineConfig(3, 3, max_batch=4, max_model_len=128, adaptive=False)
    target, draft = load_model(str(tiny_llama), "float32"), load_model(str(tiny_llama_draft), "float32")
    walked = Engine(target, ModelDrafter(draft), config)
    assert not walked.target.backend.batched_acceptance
    batched = Engine(target, ModelDrafter(draft), config)
    batched.target.backend.batched_acceptance = True  # type: ignore[misc]
    assert generate(batched, prompts, params) == generate(walked, prompts, params)
    assert batched.totals.accepted_tokens > 0


DRAFTER_CALLS = ("propose", "commit", "observe", "prefill", "release", "retain", "move", "share")


def counted_steps(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[tuple[int, int]]:
    """(syncs, copies) of every decode step (no prompt prefilled in it), outside the drafter:
    drafting reads each level it grows, and these steps' own transfers are what is held here."""
    mode = TransferCounter()
    with mode:
        mode.adopt(engine)
        drafter = engine.drafter
        if drafter is not None:
            for name in DRAFTER_CALLS:
                call = getattr(drafter, name, None)
                if call is not None:
                    setattr(drafter, name, uncounted(mode, call))
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        counts = []
        while engine.has_unfinished():
            prefilling = any(s.prefilling for s in engine.running) or bool(engine.waiting)
            mode.reset()
            engine.step()
            if not prefilling:
                counts.append((sum(mode.syncs.values()), sum(mode.copies.values())))
    assert mode.caught == []
    return counts


def uncounted(mode: TransferCounter, call: Callable) -> Callable:
    def run(*args: object, **kwargs: object) -> object:
        with mode.uncounted():
            return call(*args, **kwargs)

    return run


# A step's transfers outside drafting: one read of the accepted paths and tokens; copies of the
# forward's inputs (one with CUDA graphs), the acceptance inputs and the compaction's index.
MOST_SYNCS, MOST_COPIES = 1, 10


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=10, ignore_eos=True),
        SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=3),
        SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, top_p=0.9),
    ],
    ids=["greedy", "seeded", "unseeded"],
)
def test_a_step_transfers_a_constant_whatever_the_batch_and_tree(
    tiny_llama: Path, tiny_llama_draft: Path, params: SamplingParams
) -> None:
    target, draft = load_model(str(tiny_llama), "float32"), load_model(str(tiny_llama_draft), "float32")
    seen = {}
    shapes = [(1, 1, 1, False), (4, 1, 1, False), (4, 3, 4, False), (1, 3, 4, False), (4, 3, 4, True)]
    for batch, num_candidates, depth, graphs in shapes:
        config = EngineConfig(
            num_candidates,
            depth,
            max_batch=batch,
            max_model_len=128,
            adaptive=False,
            backend="torch",
            cuda_graphs=graphs,
        )
        engine = Engine(target, ModelDrafter(draft) if depth > 1 else None, config)
        counts = counted_steps(engine, random_prompts(41, (5, 17, 9, 11)[:batch]), params)
        seen[batch, num_candidates, depth, graphs] = max(counts)
        assert engine.planner.steps > len(counts) > 0
    assert all(syncs <= MOST_SYNCS and copies <= MOST_COPIES for syncs, copies in seen.values()), seen
    assert seen[4, 3, 4, True][1] <= 3  # a graph replay's inputs: one copy
