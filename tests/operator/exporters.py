"""Real Prometheus exporters (prometheus_client's HTTP server) with the serving image's queue metrics,
each on its own loopback address, standing in for target pods."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server

QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Exporter:
    host: str
    port: int
    queue: Histogram
    waiting: Gauge
    server: Any

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"


def free_port() -> int:
    """A port free on 127.0.0.1; the other 127.0.0.x addresses are checked when binding."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    server, thread = start_http_server(port, addr=host, registry=registry)
    try:
        yield Exporter(host, port, queue, waiting, server)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
