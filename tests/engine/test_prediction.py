"""Predicted outputs (``engine/prediction.py``): alignment, and outputs identical to plain
decoding whatever the prediction (right, partly right, wrong, hostile), with every drafter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from multiguess import LLM, SamplingParams
from multiguess.engine.adaptive import RATE_CAP, CopyYield, ForwardCost
from multiguess.engine.prediction import START, Alignment, align, prediction_draft, prediction_prospect
from multiguess.engine.sequence import SOURCES
from multiguess.errors import InvalidRequestError

from tests.engine.test_lossless import random_prompts


def test_align_follows_the_output_and_re_anchors_after_an_edit() -> None:
    prediction = np.array([10, 11, 12, 13, 14, 11, 12, 15, 16])
    start = align(prediction, [], 0)
    assert start is not None and (start.length, start.end) == (START, -1)
    agreeing = align(prediction, [10, 11, 12], 0)
    assert agreeing is not None and (agreeing.length, agreeing.end) == (3, 2)
    edited = align(prediction, [10, 99, 11, 12], 3)  # "11 12" twice: the one at or after 3 first
    assert edited is not None and (edited.length, edited.end) == (2, 6)
    before = align(prediction, [10, 99, 11, 12], 8)  # nothing after 8: the nearest before
    assert before is not None and before.end == 6
    assert align(prediction, [10, 99], 0) is None  # 99 occurs nowhere


def test_prediction_draft_is_the_chain_after_the_alignment() -> None:
    alignment = Alignment(np.array([10, 11, 12, 13, 14]))
    alignment.sync([10, 11])
    draft = prediction_draft(11, alignment.locate(), 2, CopyYield())
    assert draft is not None
    assert draft.tree.tokens == (11, 12, 13) and alignment.anchor == 2 and draft.match == 2
    alignment.sync([10, 11, 12, 13, 14])
    assert alignment.locate() is None and alignment.anchor == 2  # used up: the anchor stays
    assert prediction_draft(14, None, 8, CopyYield()) is None


def test_a_predictions_prospect_is_the_rate_and_depth_of_the_chain_it_would_draft() -> None:
    """What the planner weighs before building (``prediction_prospect``) is the built chain's
    depth and first rate, and each level reaches that rate to its depth, which is what
    ``adaptive.copies_may_widen`` bounds."""
    rng = np.random.default_rng(11)
    yields = CopyYield(rates=list(rng.uniform(0.0, 1.0, size=8)))
    for _ in range(200):
        prediction = np.array(rng.integers(0, 6, size=int(rng.integers(2, 60))))
        alignment = Alignment(prediction)
        alignment.sync([int(t) for t in rng.integers(0, 6, size=int(rng.integers(0, 20)))])
        match, depth = alignment.locate(), int(rng.integers(0, 12))
        if match is None:
            continue
        draft, shape = prediction_draft(7, match, depth, yields), prediction_prospect(match, depth, yields)
        if draft is None:
            assert shape is None and depth == 0
            continue
        assert shape is not None
        rate, levels = shape
        assert levels == len(draft.tree) - 1 >= 1
        assert draft.reach == pytest.approx([min(rate, RATE_CAP) ** d for d in range(1, levels + 1)])


def brute_force_match(prediction: list[int], output: list[int], anchor: int, most: int) -> tuple[int, int]:
    """The longest occurrence of the output's suffix (at most ``most``) followed by a token,
    the nearest at or after ``anchor`` first: (length, end)."""
    found = []
    for end in range(len(prediction) - 1):
        length = 0
        while length < min(most, len(output), end + 1) and prediction[end - length] == output[-1 - length]:
            length += 1
        if length:
            distance = end - anchor if end >= anchor else len(prediction) + anchor - end
            found.append((-length, distance, end))
    length, _, end = min(found)
    return -length, end


def test_alignment_kept_as_the_output_grows_agrees_with_the_brute_force_specification() -> None:
    rng = np.random.default_rng(5)
    prediction = [int(t) for t in rng.integers(0, 4, 200)]
    output = [int(t) for t in rng.integers(0, 4, 120)]
    kept = Alignment(np.array(prediction), max_match=16)
    for size in range(1, len(output) + 1):
        kept.sync(output[:size])
        kept.anchor = 2 * size
        found = kept.match()
        assert found is not None
        assert (found.length, found.end) == brute_force_match(prediction, output[:size], 2 * size, 16)


PARAMS = {
    "greedy": SamplingParams(max_tokens=40, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.7, seed=3),
    "penalized": SamplingParams(max_tokens=40, ignore_eos=True, frequency_penalty=0.5, logprobs=2),
}


@pytest.fixture(scope="module")
def plain(tiny_llama: Path) -> dict:
    prompts = random_prompts(21, (5, 17, 40))
    llm = LLM(str(tiny_llama), None, dtype="float32", max_batch=3)
    return {name: (prompts, llm.generate(prompts, p)) for name, p in PARAMS.items()}


def edited(tokens: list[int]) -> list[int]:
    """A prediction with edits: a token changed, one inserted, a stretch deleted."""
    out = list(tokens)
    out[5] = 4 + (out[5] + 1) % 60
    out.insert(12, 9)
    del out[20:24]
    return out


@pytest.mark.parametrize("setting", list(PARAMS))
@pytest.mark.parametrize("kind", ["right", "edited", "wrong", "enormous", "empty"])
@pytest.mark.parametrize("drafter", ["none", "model", "suffix"])
def test_predicted_outputs_are_lossless_whatever_the_prediction(
    tiny_llama: Path, tiny_llama_draft: Path, plain: dict, setting: str, kind: str, drafter: str
) -> None:
    """Batched with sequences joining and leaving, token ids and log-probabilities are plain
    decoding's; a right prediction is accepted nearly whole, an edited one mostly."""
    prompts, expected = plain[setting]
    outputs = [o.outputs[0].token_ids for o in expected]
    predictions = {
        "right": outputs,
        "edited": [edited(o) for o in outputs],
        "wrong": random_prompts(22, (40,) * len(prompts)),
        "enormous": random_prompts(23, (400,) * len(prompts)),
        "empty": [[] for _ in prompts],
    }[kind]
    draft = str(tiny_llama_draft) if drafter == "model" else None
    llm = LLM(str(tiny_llama), draft, drafter=drafter, dtype="float32", max_batch=2, max_model_len=512)
    # every width costs alike: acceptance, not timing, is tested
    llm.engine.planner.forward_cost = ForwardCost()
    for i, (prompt, predicted) in enumerate(zip(prompts, predictions, strict=True)):
        llm.engine.add_request(
            str(i), prompt, SamplingParams(**{**vars(PARAMS[setting]), "prediction": predicted})
        )
    done = {}
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = out.sequence
    seqs = [done[str(i)] for i in range(len(prompts))]
    assert [s.output_ids for s in seqs] == outputs
    if setting == "penalized":
        for seq, out in zip(seqs, expected, strict=True):  # batch shapes differ: fp32 rounding apart
            assert [r.token for r in seq.logprobs] == [r.token for r in out.outputs[0].logprobs]
            got, want = ([r.logprob for r in records] for records in (seq.logprobs, out.outputs[0].logprobs))
            assert got == pytest.approx(want, abs=1e-4)
    for stats in (s.stats for s in seqs):  # every drafted and accepted token has one source
        assert sum(getattr(stats, f"{source}_draft_tokens") for source in SOURCES) == stats.draft_tokens
        assert sum(getattr(stats, f"{source}_accepted_tokens") for source in SOURCES) == stats.accepted_tokens
    if kind == "right" and drafter == "model":  # the prediction covers what the model would guess
        assert sum(s.stats.model_steps for s in seqs) < sum(s.stats.prediction_steps for s in seqs)
    accepted = sum(s.stats.prediction_accepted_tokens for s in seqs)
    # Each step adds one token of its own; a draft model's nodes that spell the prediction too
    # count as the model's.
    share = {"right": 0.7, "edited": 0.5}.get(kind, 0.0) * (drafter != "model")
    assert accepted >= share * sum(len(o) for o in outputs)
    if kind in ("right", "edited"):
        assert accepted > 0
    if kind == "empty":
        assert sum(s.stats.prediction_draft_tokens for s in seqs) == 0


def test_a_prediction_longer_than_the_context_is_refused(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), None, dtype="float32", max_model_len=64)
    with pytest.raises(InvalidRequestError, match="longer than the context length of 64"):
        llm.engine.add_request("x", [5, 6], SamplingParams(prediction=[5] * 65))
    with pytest.raises(InvalidRequestError, match="prediction token ids"):
        llm.engine.add_request("y", [5, 6], SamplingParams(prediction=[10**6]))
    text = llm.generate([5, 6, 7], SamplingParams(max_tokens=8, prediction="w1 w2 w3"))[0]
    assert len(text.outputs[0].token_ids) == 8
