"""The autoscaling daemons' loop: one step per interval for one pool of one resource, until kopf
cancels it. kopf's daemons (handlers.py) are thin wrappers that name the pool."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import kopf
import urllib3.exceptions

from multiguess_operator.autoscaler.loop import (
    Autoscaler,
    DraftAutoscaler,
    StepResult,
    draft_step,
    step,
)
from multiguess_operator.kube import Kube
from multiguess_operator.spec import DeploymentSpec, SpecError, parse_spec

INVALID_SPEC_PAUSE = 15  # seconds between looks at a spec the reconciler reports as invalid


@dataclass(frozen=True)
class Pool:
    """What differs between scaling the targets and scaling the draft pool."""

    noun: str  # for events and logs
    status_key: str  # where the pool's autoscaler keeps its state in ``status``
    restore: Callable[[Any], Any]
    step: Callable[[Kube, Any, str, str, DeploymentSpec, float], Awaitable[StepResult]]
    interval: Callable[[DeploymentSpec], int | None]  # None: this pool is not autoscaled now
    event_prefix: str


TARGETS = Pool(
    "replicas",
    "autoscaling",
    Autoscaler.restore,
    step,
    lambda spec: spec.autoscaling.interval_seconds if spec.autoscaling.enabled else None,
    "",
)
DRAFTS = Pool(
    "draft replicas",
    "draftAutoscaling",
    DraftAutoscaler.restore,
    draft_step,
    lambda spec: (
        spec.separate_draft.autoscaling.interval_seconds
        if spec.separate_draft is not None and spec.separate_draft.autoscaling.enabled
        else None
    ),
    "Draft",
)


async def run(
    pool: Pool, stopped: kopf.DaemonStopped, body: kopf.Body, name: str, namespace: str, logger: Any
) -> None:
    """Per resource, every interval (read afresh each round, so spec edits apply at once). It pauses
    with ``asyncio.sleep`` and stops when kopf cancels it: ``await stopped.wait(n)`` runs a helper
    task that ends in TimeoutError, and kopf re-raises the error of every task alive when the
    operator stops, so a daemon paused at that moment would fail ``kopf run``."""
    scaler = pool.restore((body.get("status") or {}).get(pool.status_key))
    kube = Kube()
    while not stopped:
        try:
            spec = parse_spec(body.get("spec") or {})
        except SpecError:
            await asyncio.sleep(INVALID_SPEC_PAUSE)  # reported by the reconciler; wait for a fix
            continue
        interval = pool.interval(spec)
        if interval is None:  # kopf stops the daemon when its filter stops matching
            await asyncio.sleep(INVALID_SPEC_PAUSE)
            continue
        try:
            result = await pool.step(kube, scaler, name, namespace, spec, time.time())
        except (TimeoutError, OSError, RuntimeError, urllib3.exceptions.HTTPError) as e:  # API trouble: retry
            logger.warning(f"autoscaler step ({pool.noun}) failed: {e}")
        else:
            report(pool, body, result, logger)
        await asyncio.sleep(interval)


def report(pool: Pool, body: kopf.Body, result: StepResult, logger: Any) -> None:
    if result.unreachable:
        logger.warning(f"could not scrape: {', '.join(sorted(result.unreachable))}")
    new = result.decision.replicas
    if new != result.current:
        direction = "ScaledUp" if new > result.current else "ScaledDown"
        message = (
            f"{result.current} -> {new} {pool.noun} ({result.decision.reason}; "
            f"signal {result.signal.value}, ratio {result.signal.ratio})"
        )
        kopf.info(dict(body), reason=pool.event_prefix + direction, message=message)
