"""The cost curve the policy reads follows the verification forwards as they run
(``engine/forward_times.py``): refitted to their recent times, attention left out, medians so one
stalled forward moves nothing, non-decreasing; the engine feeds it every verification forward."""

from __future__ import annotations

from pathlib import Path

import pytest
from multiguess import SamplingParams
from multiguess.engine.adaptive import ForwardCost
from multiguess.engine.config import EngineConfig
from multiguess.engine.drafters.model import ModelDrafter
from multiguess.engine.engine import Engine
from multiguess.engine.forward_times import ForwardTimes
from multiguess.models.loading import load_model

from tests.engine.test_lossless import random_prompts, reference

CURVE = ForwardCost((1, 2, 4, 8, 16), (1.0, 1.0, 1.0, 2.0, 4.0))


def test_each_point_follows_its_own_forwards_and_the_others_the_nearest_measured_one() -> None:
    times = ForwardTimes(CURVE, every=16, least=8)
    refits = [times.record([(1, 0)] * 4, 1.0) for _ in range(8)]  # 4 tokens at the curve's time
    refits += [times.record([(2, 0)] * 4, 3.0) for _ in range(8)]  # 8 tokens at 1.5x
    assert refits[:-1] == [None] * 15  # refitted every 16 forwards
    assert refits[-1] is not None
    assert refits[-1].seconds == (1.0, 1.0, 1.0, 3.0, 6.0)  # 16 scales as 8, its nearest
    assert refits[-1].tokens == CURVE.tokens


def test_the_attention_the_curve_prices_is_left_out() -> None:
    """Forwards as dear as the curve plus the attention it prices leave the curve as it is."""
    curve = ForwardCost(CURVE.tokens, CURVE.seconds, per_sequence=1e-3, per_row=1e-3)
    times = ForwardTimes(curve, every=8, least=8)
    sequences = [(2, 100), (1, 300)]
    took = curve(3) + sum(curve.attended(rows, context) for rows, context in sequences)
    refits = [times.record(sequences, took) for _ in range(8)]
    assert refits[-1] is not None
    assert refits[-1].seconds == pytest.approx(curve.seconds)


def test_one_stalled_forward_moves_nothing_and_more_tokens_never_cost_less() -> None:
    times = ForwardTimes(CURVE, every=9, least=8)
    for _ in range(8):
        times.record([(4, 0)], 0.5)  # 4 tokens at half the curve's time
    refitted = times.record([(4, 0)], 100.0)  # a stall
    assert refitted is not None
    assert refitted.seconds == (0.5, 0.5, 0.5, 1.0, 2.0)
    times = ForwardTimes(CURVE, every=16, least=8)
    for _ in range(8):
        times.record([(4, 0)], 2.0)  # 4 tokens at twice the curve
        refitted = times.record([(8, 0)], 1.0)  # 8 at half of it
    assert refitted is not None
    assert refitted.seconds == (2.0, 2.0, 2.0, 2.0, 2.0)  # 8 tokens never below 4


@pytest.mark.parametrize(("tokens", "point"), [(1, 0), (3, 2), (5, 2), (6, 3), (12, 4), (40, 4)])
def test_a_forward_counts_at_the_curve_point_nearest_its_tokens(tokens: int, point: int) -> None:
    times = ForwardTimes(CURVE)
    times.record([(tokens, 0)], 1.0)
    assert [len(r) for r in times.ratios] == [int(i == point) for i in range(len(CURVE.tokens))]


def test_the_engine_refits_the_curve_to_its_verification_forwards(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    """Every verification forward is recorded, prefill forwards are not; the policy plans from
    the refitted curve; the output stays plain decoding's."""
    target, draft = (load_model(str(path), dtype="float32") for path in (tiny_llama, tiny_llama_draft))
    engine = Engine(target, ModelDrafter(draft), EngineConfig(max_batch=2, max_model_len=128))
    measured = engine.planner.forward_cost
    engine.planner.forward_times = ForwardTimes(measured, every=4, least=1)
    prompts = random_prompts(5, (7, 11))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    outputs: dict[str, list[int]] = {}
    verifications = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        verifications += bool(engine.last_tree_sizes)
    assert engine.planner.forward_times.count == verifications > 4
    assert engine.planner.forward_cost is not measured
    assert engine.planner.forward_cost.tokens == measured.tokens
    assert [outputs[str(i)] for i in range(len(prompts))] == reference(
        tiny_llama, prompts, 16, ignore_eos=True
    )
