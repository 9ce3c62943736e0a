"""Real Prometheus exporters (prometheus_client's HTTP server), each on its own loopback address,
standing in for pods: target pods with the serving image's queue, speculation and remote-draft
metrics; draft pods with the draft server's step histogram and request counter (the names and
buckets are the serving image's; test_autoscaler_metrics checks them against its registries)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
FAILURE_KINDS = ("timeout", "connection", "protocol", "server", "incompatible")


@dataclass
class Exporter:
    """A target pod's metrics."""

    host: str
    port: int
    queue: Histogram
    waiting: Gauge
    verify_steps: Counter
    accepted_tokens: Counter
    fallback_steps: Counter
    draft_failures: Counter  # label kind
    server: Any

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def steps(self, count: int, accepted_per_step: float = 0.0, fallbacks: int = 0) -> None:
        """``count`` verification steps (``fallbacks`` of them without a draft)."""
        self.verify_steps.inc(count)
        self.accepted_tokens.inc((count - fallbacks) * accepted_per_step)
        if fallbacks:
            self.fallback_steps.inc(fallbacks)


@dataclass
class DraftExporter:
    """A draft server's metrics."""

    host: str
    port: int
    step: Histogram
    requests: Counter
    server: Any


def free_port() -> int:
    """A port free on 127.0.0.1; the other 127.0.0.x addresses are checked when binding."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _serving(registry: CollectorRegistry, host: str, port: int) -> Iterator[Any]:
    server, thread = start_http_server(port, addr=host, registry=registry)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@contextmanager
def exporter(host: str, port: int) -> Iterator[Exporter]:
    registry = CollectorRegistry()
    queue = Histogram(
        "multiguess_request_queue_seconds",
        "Time in the admission queue",
        buckets=QUEUE_BUCKETS,
        registry=registry,
    )
    waiting = Gauge("multiguess_requests_waiting", "Requests waiting", registry=registry)
    Gauge("multiguess_requests_running", "Requests running", registry=registry).set(1)
    verify = Counter("multiguess_spec_verify_steps", "Target verification forwards.", registry=registry)
    accepted = Counter("multiguess_spec_accepted_tokens", "Drafted tokens accepted.", registry=registry)
    fallback = Counter("multiguess_spec_fallback_steps", "Steps without the drafter.", registry=registry)
    failures = Counter(
        "multiguess_remote_draft_failures", "Draft steps that failed, by kind.", ["kind"], registry=registry
    )
    for kind in FAILURE_KINDS:
        failures.labels(kind=kind)
    with _serving(registry, host, port) as server:
        yield Exporter(host, port, queue, waiting, verify, accepted, fallback, failures, server)


@contextmanager
def draft_exporter(host: str, port: int) -> Iterator[DraftExporter]:
    registry = CollectorRegistry()
    step = Histogram(
        "multiguess_draft_step_seconds", "Draft compute per batch.", buckets=STEP_BUCKETS, registry=registry
    )
    requests = Counter("multiguess_draft_requests", "Draft requests served.", registry=registry)
    with _serving(registry, host, port) as server:
        yield DraftExporter(host, port, step, requests, server)
