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
        # The drafter's own accepted tokens: copy drafts grafted onto its trees are not its guesses.
        accepted_before = by_label(client, "multiguess_spec_source_accepted_tokens_total", "source")["draft"]
        before = {n: by_label(client, n, "depth") for n in names}
        ranks_before = by_label(client, "multiguess_spec_accepted_rank_total", "rank")
        body = {"prompt": "w1 w2 w3 w4 w1 w2 w3", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        assert client.post("/v1/completions", json=body).status_code == 200
        accepted = (
            by_label(client, "multiguess_spec_source_accepted_tokens_total", "source")["draft"]
            - accepted_before
        )
        after = {n: by_label(client, n, "depth") for n in names}
        ranks = by_label(client, "multiguess_spec_accepted_rank_total", "rank")
    verified, hits = ({d: v - before[n].get(d, 0.0) for d, v in after[n].items()} for n in names)
    assert verified.get("1", 0) > 0
    assert sum(hits.values()) == accepted == sum(v - ranks_before.get(r, 0.0) for r, v in ranks.items())
    for depth, count in hits.items():
        assert count <= verified[depth]
        if depth != "1":  # a level is verified only below an accepted one
            assert verified[depth] <= hits[str(int(depth) - 1)]


def test_tokens_by_source_add_up_to_the_drafted_and_accepted_tokens(server: LiveServer) -> None:
    """/metrics splits drafted and accepted tokens by source (the drafter's own, copy drafts);
    a reply repeating its prompt is partly accepted from copies, and the sources add up."""
    names = {
        "draft": "multiguess_spec_draft_tokens_total",
        "accepted": "multiguess_spec_accepted_tokens_total",
    }
    sources = {k: f"multiguess_spec_source_{k}_tokens_total" for k in names}
    with server.client() as client:
        before = {k: metric(client, n) for k, n in names.items()}
        by_source_before = {k: by_label(client, n, "source") for k, n in sources.items()}
        body = {"prompt": "w1 w2 w3 w4 w5 w6 " * 6, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200
        totals = {k: metric(client, n) - before[k] for k, n in names.items()}
        by_source = {
            k: {s: v - by_source_before[k].get(s, 0.0) for s, v in by_label(client, n, "source").items()}
            for k, n in sources.items()
        }
    assert set(by_source["draft"]) == {"draft", "copy", "prediction"}
    for kind in names:
        assert sum(by_source[kind].values()) == totals[kind]
    assert by_source["accepted"]["copy"] > 0
