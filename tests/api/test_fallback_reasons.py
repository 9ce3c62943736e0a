"""Steps decoded without the draft are counted by why: the exception says of itself."""

from __future__ import annotations

import collections

from multiguess.engine.guard import FALLBACK_REASONS, DrafterUnavailable, InvalidDraft, fallback_reason
from multiguess.engine.sequence import SpecStats
from multiguess.metrics import Metrics
from multiguess.remote.client import DraftTimeout, RemoteDraftError, ServerRefused
from prometheus_client.parser import text_string_to_metric_families


def test_each_failure_names_its_reason() -> None:
    assert fallback_reason(DraftTimeout("slow")) == "timeout"
    assert fallback_reason(TimeoutError()) == "timeout"
    assert fallback_reason(ServerRefused("full")) == "refused"
    assert fallback_reason(InvalidDraft("token 99 out of range")) == "invalid"
    assert fallback_reason(DrafterUnavailable("paused")) == "paused"
    assert fallback_reason(RemoteDraftError("connection failed")) == "error"
    assert fallback_reason(RuntimeError("boom")) == "error"


def test_the_counter_carries_every_reason_from_the_start_and_moves_by_reason() -> None:
    metrics = Metrics()
    metrics.add_spec(SpecStats(), SpecStats(), collections.Counter({"timeout": 3, "invalid": 1}))
    series = {
        sample.labels["reason"]: sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
        if sample.name == "multiguess_spec_fallback_steps_total"
    }
    assert set(series) == set(FALLBACK_REASONS)
    assert series["timeout"] == 3 and series["invalid"] == 1 and series["error"] == 0
