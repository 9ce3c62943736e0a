"""Prometheus metrics of remote drafting, on both sides (prefix ``multiguess_``).

Target side (``ClientMetrics``, in the serving image's registry): the per-step round trip,
sessions re-sent after an eviction, failures by kind, reconnects and the bytes sent. Draft side
(``ServerMetrics``): draft compute per batch, sessions held, evictions, connections.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
FAILURE_KINDS = ("timeout", "connection", "protocol", "server", "incompatible", "auth")
EVICTION_REASONS = ("lru", "idle")


class ClientMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.round_trip = Histogram(
            "multiguess_remote_draft_round_trip_seconds",
            "Per engine step: sending the draft requests until every tree is back (resends included).",
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self.server_time = Histogram(
            "multiguess_remote_draft_server_seconds",
            "Per engine step: the draft server's own compute, as it reports it.",
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self.resends = Counter(
            "multiguess_remote_draft_resends",
            "Sequences sent again in full because the draft server had evicted their session.",
            registry=registry,
        )
        self.failures = Counter(
            "multiguess_remote_draft_failures",
            "Draft steps that failed (the step then decodes with the target alone), by kind.",
            ["kind"],
            registry=registry,
        )
        self.refused = Counter(
            "multiguess_remote_draft_refused",
            "Sequences the draft server did not draft for a step (too long, no free session): target alone.",
            registry=registry,
        )
        self.reconnects = Counter(
            "multiguess_remote_draft_connects", "Connections opened to the draft server.", registry=registry
        )
        self.sent_bytes = Counter(
            "multiguess_remote_draft_sent_bytes",
            "Bytes of step messages sent to the draft server (tokens, paths and features).",
            registry=registry,
        )
        for kind in FAILURE_KINDS:
            self.failures.labels(kind=kind)


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.step = Histogram(
            "multiguess_draft_step_seconds",
            "Draft compute per batch (requests of all clients that arrived together).",
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self.batch = Histogram(
            "multiguess_draft_batch_requests",
            "Draft requests served by one batched propose.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=registry,
        )
        self.sessions = Gauge(
            "multiguess_draft_sessions", "Sessions holding a draft-cache slot.", registry=registry
        )
        self.evictions = Counter(
            "multiguess_draft_session_evictions",
            "Sessions evicted, by reason.",
            ["reason"],
            registry=registry,
        )
        self.resends = Counter(
            "multiguess_draft_resends",
            "Requests answered 'resend the sequence' (unknown session).",
            registry=registry,
        )
        self.failed = Counter(
            "multiguess_draft_failed_requests", "Requests answered with a failure.", registry=registry
        )
        self.requests = Counter(
            "multiguess_draft_requests", "Draft requests served with a tree.", registry=registry
        )
        self.connections = Gauge(
            "multiguess_draft_connections", "Open client connections.", registry=registry
        )
        self.auth_failures = Counter(
            "multiguess_draft_auth_failures",
            "Connections refused because they did not prove they hold the draft secret.",
            registry=registry,
        )
        for reason in EVICTION_REASONS:
            self.evictions.labels(reason=reason)
