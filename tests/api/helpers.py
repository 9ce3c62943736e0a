"""Small helpers shared by the API tests: SSE parsing and metric reading."""

from __future__ import annotations

import json
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


def sse_events(lines: list[str]) -> list[Any]:
    """The ``data:`` payloads of a stream, JSON-decoded; ``[DONE]`` stays a string."""
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    """A sample's value from /metrics, summed over the label sets that match ``labels`` (0 when
    absent)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(client.get("/metrics").text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )
