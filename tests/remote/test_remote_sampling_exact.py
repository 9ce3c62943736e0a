"""Sampling through a draft server keeps the target's output distribution exactly.

The same enumeration and chi-square test as the local drafter's (tests/engine), with the draft
on a real draft server: the float32 rows that travel must be exactly what children were drawn
from, or acceptance would be biased.
"""

from __future__ import annotations

import pytest
from multiguess import LLM, SamplingParams
from multiguess.drafting import Serving
from multiguess.remote.server import DraftServerSettings

from tests.engine import test_sampling_exact as exact
from tests.engine.test_sampling_exact import small_vocab_pair  # noqa: F401  (the shared fixture)
from tests.remote.conftest import DraftServer

SETTINGS = {"t1": dict(temperature=1.0), "t1.3-topp0.8": dict(temperature=1.3, top_p=0.8)}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_remote_sampling_matches_the_target_exactly(request: pytest.FixtureRequest, setting: str) -> None:
    target, draft = request.getfixturevalue("small_vocab_pair")
    server = DraftServer(
        draft, DraftServerSettings(max_sessions=256, max_model_len=16, max_tree_nodes=16)
    ).start()
    try:
        serving = Serving(step_timeout=30, url=server.url)
        llm = LLM(str(target), None, 3, 2, dtype="float32", max_batch=256, drafter="none", adaptive=False,
                  serving=serving)  # fmt: skip
        params = SamplingParams(
            max_tokens=exact.LENGTH, ignore_eos=True, n=exact.SAMPLES, seed=17, **SETTINGS[setting]
        )
        samples = exact.draw(llm, params)
        stats = llm.engine.totals
    finally:
        server.stop()
    assert stats.accepted_tokens > 0 and stats.fallback_steps == 0
    pvalue = exact.chi_square_pvalue(samples, exact.exact_distribution(target, params))
    assert len(samples) == exact.SAMPLES
    assert pvalue > exact.ALPHA, f"{setting}: p = {pvalue:.2e}"
