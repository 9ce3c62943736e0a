"""Spec parsing: defaults, type errors with the field's path, and resource names that fit Services."""

from __future__ import annotations

from typing import Any

import pytest
from multiguess_operator.spec import MAX_NAME_LENGTH, SpecError, check_name, parse_spec

BASE: dict[str, Any] = {
    "target": {"model": "org/t", "gpu": {"product": "NVIDIA-A100-SXM4-40GB"}},
    "draft": {"model": "org/d"},
}


def with_(**changes: Any) -> dict[str, Any]:
    return {**BASE, **changes}


def test_minimal_spec_takes_defaults() -> None:
    spec = parse_spec(BASE)
    assert spec.replicas == 1
    assert spec.draft is not None and spec.draft.placement == "colocated"
    assert spec.separate_draft is None
    assert (spec.speculation.num_candidates, spec.speculation.depth, spec.speculation.max_nodes) == (3, 4, 16)
    assert spec.autoscaling.enabled is False
    assert spec.serving.request_timeout_seconds == 60.0


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (with_(replicas="2"), "spec.replicas: expected an integer, got '2'"),
        (with_(replicas=True), "spec.replicas: expected an integer, got True"),
        (with_(replicas=-1), "spec.replicas: must be positive, got -1"),
        (
            with_(serving={"requestTimeoutSeconds": 0}),
            "spec.serving.requestTimeoutSeconds: must be positive, got 0",
        ),
        (with_(serving={"port": 80.5}), "spec.serving.port: expected an integer, got 80.5"),
        (
            with_(target={"model": "", "gpu": {"product": "x"}}),
            "spec.target.model: expected a non-empty string",
        ),
        (with_(target={"model": "m", "gpu": "A100"}), "spec.target.gpu: expected an object, got str"),
        (with_(nodeSelector={"zone": 1}), "spec.nodeSelector: every value must be a string"),
        (with_(tolerations={"key": "x"}), "spec.tolerations: expected a list of objects"),
        (with_(autoscaling={"enabled": "yes"}), "spec.autoscaling.enabled: expected a boolean, got 'yes'"),
        (
            with_(target={"model": "m", "gpu": {"product": "p"}, "dtype": "int4"}),
            "spec.target.dtype: 'int4' is not one of auto, float32, bfloat16, float16",
        ),
        (with_(extra=1), "spec: unknown field(s) extra"),
        ({"draft": {"model": "d"}}, "spec.target is required"),
    ],
)
def test_bad_values_name_the_field(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(raw)
    assert caught.value.reason == "InvalidSpec"
    assert message in caught.value.message


def test_numbers_accept_integers_where_floats_are_expected() -> None:
    spec = parse_spec(with_(autoscaling={"targetQueueLatencySeconds": 2}))
    assert spec.autoscaling.target_queue_latency_seconds == 2.0
    assert isinstance(spec.autoscaling.target_queue_latency_seconds, float)


@pytest.mark.parametrize("name", ["demo", "a", "llama-8b", "x" * MAX_NAME_LENGTH])
def test_names_that_fit(name: str) -> None:
    check_name(name)


@pytest.mark.parametrize("name", ["x" * (MAX_NAME_LENGTH + 1), "8b-model", "has.dot", "Upper", "trailing-"])
def test_names_that_do_not_fit_services(name: str) -> None:
    with pytest.raises(SpecError) as caught:
        check_name(name)
    assert caught.value.reason == "InvalidName"
