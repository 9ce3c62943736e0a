"""kopf handlers: thin triggers around reconcile(); every path ends in the same level-based pass."""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from multiguess_operator.autoscaler import daemon as autoscaling
from multiguess_operator.kube import SPECDEPLOYS, Kube
from multiguess_operator.names import GROUP, INSTANCE_LABEL, MANAGED_BY_LABEL, MANAGER, PLURAL, VERSION
from multiguess_operator.reconcile import REFUSED, Outcome, delete_children, reconcile, status_changed
from multiguess_operator.settings import Settings

CHILD_RESOURCES = (("apps/v1", "deployments"), ("v1", "services"), ("policy/v1", "poddisruptionbudgets"))
OWNED = {MANAGED_BY_LABEL: MANAGER}
RETRY_REFUSED_SECONDS = 30  # a refused write is retried: a policy, quota or webhook may change


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Read the operator's settings once; keep kopf's own bookkeeping under our domain."""
    memo.config = Settings.from_env()
    settings.posting.level = logging.INFO
    settings.persistence.finalizer = f"{GROUP}/cleanup"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # Watch only the operator's own children, filtered by the API server, not every Deployment,
    # Service and PodDisruptionBudget in the cluster.
    owned = ",".join(f"{k}={v}" for k, v in OWNED.items())
    for api_version, plural in CHILD_RESOURCES:
        settings.watching.label_selectors[(*api_version.split("/"), plural)] = owned


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """Authenticate through the official client, which the handlers' API calls then share."""
    return kopf.login_via_client(**kwargs)


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def converge(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    run_pass(Kube(), body, memo.config, logger)


def _refused(status: kopf.Status, **_: Any) -> bool:
    conditions = status.get("conditions") or []
    return any(c.get("type") == "Degraded" and c.get("reason") == REFUSED for c in conditions)


@kopf.timer(GROUP, VERSION, PLURAL, interval=RETRY_REFUSED_SECONDS, when=_refused)
def retry_refused(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Nothing tells the operator when a refusing policy, quota or webhook changes: try again.

    A timer rather than a handler's retry: a retrying handler would hold back the next spec
    change (often the fix) until its delay is over.
    """
    run_pass(Kube(), body, memo.config, logger)


def _on_child_event(meta: kopf.Meta, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """A child appeared, changed or vanished: converge its owner (which restores the child)."""
    owner = meta.get("labels", {}).get(INSTANCE_LABEL)
    if not owner or not meta.get("namespace"):
        return
    kube = Kube()
    body = kube.get(SPECDEPLOYS, meta["namespace"], owner)
    if body is None or body.get("metadata", {}).get("deletionTimestamp"):
        return
    run_pass(kube, body, memo.config, logger)


for _api_version, _plural in CHILD_RESOURCES:
    kopf.on.event(_api_version, _plural, labels=OWNED, id=f"child-{_plural}")(_on_child_event)


@kopf.on.delete(GROUP, VERSION, PLURAL)
def cleanup(name: str, namespace: str, logger: kopf.Logger, **_: Any) -> None:
    for message in delete_children(Kube(), name, namespace):
        logger.info(message)


def _autoscaling_enabled(spec: kopf.Spec, **_: Any) -> bool:
    return bool((spec.get("autoscaling") or {}).get("enabled"))


def _draft_autoscaling_enabled(spec: kopf.Spec, **_: Any) -> bool:
    draft = spec.get("draft") or {}
    return draft.get("placement") == "separate" and bool((draft.get("autoscaling") or {}).get("enabled"))


@kopf.daemon(GROUP, VERSION, PLURAL, when=_autoscaling_enabled, cancellation_timeout=10.0)
async def autoscale(
    stopped: kopf.DaemonStopped, body: kopf.Body, name: str, namespace: str, logger: kopf.Logger, **_: Any
) -> None:
    """The target pods' autoscaler, every ``autoscaling.intervalSeconds``. A daemon rather than a
    kopf timer: a timer's interval is fixed when the handler is registered."""
    await autoscaling.run(autoscaling.TARGETS, stopped, body, name, namespace, logger)


@kopf.daemon(GROUP, VERSION, PLURAL, when=_draft_autoscaling_enabled, cancellation_timeout=10.0)
async def autoscale_draft(
    stopped: kopf.DaemonStopped, body: kopf.Body, name: str, namespace: str, logger: kopf.Logger, **_: Any
) -> None:
    """The draft pool's autoscaler (``placement: separate``), every ``draft.autoscaling.intervalSeconds``."""
    await autoscaling.run(autoscaling.DRAFTS, stopped, body, name, namespace, logger)


def run_pass(kube: Kube, body: Mapping[str, Any], config: Settings, logger: kopf.Logger) -> Outcome:
    """Reconcile, write the status if it changed, and tell the user what happened through events."""
    meta = body["metadata"]
    previous = body.get("status") or {}
    outcome = reconcile(kube, body, config.image, now())
    if status_changed(previous, outcome.status):
        kube.merge_patch(SPECDEPLOYS, meta["namespace"], meta["name"], {"status": outcome.status}, "status")
    for reason, message in outcome.actions:
        kopf.info(dict(body), reason=reason, message=message)
    if outcome.error is not None and _message(previous, "Ready") != outcome.error.message:
        logger.warning(f"invalid spec: {outcome.error.message}")
        kopf.warn(dict(body), reason=outcome.error.reason, message=outcome.error.message)
    # Each problem is announced once, when it first appears, not on every pass that still sees it.
    before = _message(previous, "Degraded") or ""
    for problem in outcome.problems:
        if problem.message not in before:
            logger.warning(f"{problem.reason}: {problem.message}")
            kopf.warn(dict(body), reason=problem.reason, message=problem.message)
    return outcome


def _message(status: Mapping[str, Any], ctype: str) -> str | None:
    for cond in status.get("conditions") or []:
        if cond.get("type") == ctype:
            return cond.get("message")
    return None


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
