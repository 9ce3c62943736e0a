"""Fetch /metrics from every ready pod of a pool, concurrently; a pod that fails is reported, not fatal."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from multiguess_operator.autoscaler.metrics import MetricsError, Snapshot, parse


@dataclass(frozen=True)
class PodTarget:
    name: str
    uid: str
    url: str


def ready_targets(pods: Sequence[Mapping[str, Any]], port: int) -> list[PodTarget]:
    """Pods that serve traffic now: Ready, with an IP, not terminating (pure)."""
    targets = []
    for pod in pods:
        meta, status = pod.get("metadata", {}), pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        )
        if ready and status.get("podIP") and not meta.get("deletionTimestamp"):
            url = f"http://{status['podIP']}:{port}/metrics"
            targets.append(PodTarget(meta["name"], meta.get("uid", meta["name"]), url))
    return sorted(targets, key=lambda t: t.name)


Reader = Callable[[str], Snapshot]


async def scrape(
    targets: Sequence[PodTarget], timeout: float = 5.0, parse: Reader = parse
) -> tuple[dict[str, Snapshot], dict[str, str]]:
    """(snapshots by pod uid, error by pod name) for all targets, fetched in parallel and read
    with ``parse`` (target pods' pages by default)."""
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(timeout=client_timeout) as session:
        results = await asyncio.gather(*(fetch(session, t, parse) for t in targets))
    snapshots: dict[str, Snapshot] = {}
    errors: dict[str, str] = {}
    for target, result in zip(targets, results, strict=True):
        if isinstance(result, Snapshot):
            snapshots[target.uid] = result
        else:
            errors[target.name] = result
    return snapshots, errors


async def fetch(session: aiohttp.ClientSession, target: PodTarget, parse: Reader = parse) -> Snapshot | str:
    """The pod's snapshot, or why there is none. A failure is a value, not an exception: gather
    runs each fetch as a task, and kopf re-raises the error of every task still alive when the
    operator stops, so a pod that refused a scrape during shutdown failed ``kopf run``."""
    try:
        async with session.get(target.url) as response:
            if response.status != 200:
                raise MetricsError(f"HTTP {response.status} from {target.url}")
            return parse(await response.text())
    except Exception as e:  # any failure to scrape one pod is reported, never fatal
        return f"{type(e).__name__}: {e}".rstrip(": ")
