"""Where guesses land, in /metrics: acceptance by tree depth and by the accepted child's rank."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import LiveServer
from tests.api.helpers import metric


def by_label(client: httpx.Client, name: str, label: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                values[sample.labels[label]] = sample.value
    return values


def test_acceptance_by_depth_and_rank_adds_up_to_the_accepted_tokens(server: LiveServer) -> None:
    names = ("multiguess_spec_level_verified_total", "multiguess_spec_level_accepted_total")
    with server.client() as client:
        accepted_before = metric(client, "multiguess_spec_accepted_tokens_total")
        before = {n: by_label(client, n, "depth") for n in names}
        ranks_before = by_label(client, "multiguess_spec_accepted_rank_total", "rank")
        body = {"prompt": "w1 w2 w3 w4 w1 w2 w3", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        assert client.post("/v1/completions", json=body).status_code == 200
        accepted = metric(client, "multiguess_spec_accepted_tokens_total") - accepted_before
        after = {n: by_label(client, n, "depth") for n in names}
        ranks = by_label(client, "multiguess_spec_accepted_rank_total", "rank")
    verified, hits = ({d: v - before[n].get(d, 0.0) for d, v in after[n].items()} for n in names)
    assert verified.get("1", 0) > 0
    assert sum(hits.values()) == accepted == sum(v - ranks_before.get(r, 0.0) for r, v in ranks.items())
    for depth, count in hits.items():
        assert count <= verified[depth]
        if depth != "1":  # a level is verified only below an accepted one
            assert verified[depth] <= hits[str(int(depth) - 1)]
