"""Fixtures: kmock's Kubernetes emulator (an in-memory API server over real HTTP) + kopf's KopfRunner.

Three things matter when reading these tests:

* The emulator is served by the *test's* event loop while the operator runs in KopfRunner's own
  thread, so tests must ``await`` (never ``time.sleep``) while they wait for the operator.
* The emulator stores objects as plain JSON and merges patches; it does not stamp metadata. The small
  subclass below adds what kopf and the operator read: namespace, uid, resourceVersion, generation,
  creationTimestamp. There is no garbage collector and no Deployment controller: tests play those.
* A failed JSON-patch ``test`` operation is answered with 422, as kube-apiserver does (kopf relies on it).
* The official client reads KUBECONFIG at import time, so its default location is patched as well.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import jsonpatch
import kmock
import kubernetes.config.kube_config
import pytest
import yaml
from kmock import action
from kopf.testing import KopfRunner

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "speculativedeployment.yaml"
SPECDEPLOYS = "multiguess.io/v1alpha1/speculativedeployments"
DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
PDBS = "policy/v1/poddisruptionbudgets"
PODS = "v1/pods"
EVENTS = "v1/events"

_RESOURCES: dict[str, dict[str, Any]] = {
    SPECDEPLOYS: {"kind": "SpeculativeDeployment", "subresources": {"status", "scale"}},
    DEPLOYMENTS: {"kind": "Deployment", "subresources": {"status", "scale"}},
    SERVICES: {"kind": "Service"},
    PDBS: {"kind": "PodDisruptionBudget"},
    PODS: {"kind": "Pod"},
    EVENTS: {"kind": "Event"},
    "v1/namespaces": {"kind": "Namespace", "namespaced": False},
    "apiextensions.k8s.io/v1/customresourcedefinitions": {
        "kind": "CustomResourceDefinition",
        "namespaced": False,
    },
}
_VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}
_versions = itertools.count(1)


class Cluster(kmock.KubernetesEmulator):
    """The emulator plus the metadata a real API server stamps on every write."""

    async def _handle(self, request: kmock.Request) -> Any:
        data = request.data
        if request.resource is not None and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            if request.action == action.CREATE:
                if "name" not in meta and "generateName" in meta:
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                meta.setdefault("namespace", request.namespace)
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("generation", 1)
                meta.setdefault("creationTimestamp", _now())
                meta["resourceVersion"] = str(next(_versions))
            elif request.action == action.UPDATE:
                meta["resourceVersion"] = str(next(_versions))
                if "spec" in data and request.subresource != "status":
                    current = self.objects[request.resource, request.namespace, request.name]
                    if dict(current).get("spec") != data["spec"]:
                        meta["generation"] = int(current["metadata"].get("generation", 1)) + 1
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as e:
            # kube-apiserver answers a failed JSON-patch "test" (kopf's optimistic lock) with 422.
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(e)) from e

    # -- helpers for tests: real HTTP requests, so that watchers see the changes --

    async def create(self, resource: str, obj: Mapping[str, Any]) -> dict[str, Any]:
        namespace = obj["metadata"]["namespace"]
        return await self._json("POST", _path(resource, namespace), obj)

    async def patch(
        self,
        resource: str,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any]:
        return await self._json("PATCH", _path(resource, namespace, name, subresource), patch)

    async def remove(self, resource: str, namespace: str, name: str) -> dict[str, Any]:
        return await self._json("DELETE", _path(resource, namespace, name), None)

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The current stored object, or None if absent or deleted."""
        try:
            obj = self.objects[resource, namespace, name]
        except KeyError:
            return None
        return None if obj.deleted else dict(obj.raw)

    def names(self, resource: str, namespace: str) -> set[str]:
        return {
            name
            for (res, ns, name), obj in self.objects.items()
            if res == kmock.resource(resource) and ns == namespace and not obj.deleted
        }

    async def _json(self, method: str, path: str, body: Any) -> dict[str, Any]:
        async with self.request(method, path, json=body) as response:
            payload = await response.json()
            assert response.status < 400, payload
            return payload  # type: ignore[no-any-return]


def _path(resource: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    *group_version, plural = resource.split("/")
    root = "/api/v1" if group_version == ["v1"] else "/apis/" + "/".join(group_version)
    return "/".join(p for p in (root, "namespaces", namespace, plural, name, subresource) if p)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture()
async def cluster() -> AsyncIterator[Cluster]:
    async with Cluster() as emulator, kmock.Server(emulator):
        for resource, info in _RESOURCES.items():
            emulator.resources[resource] = kmock.ResourceInfo(
                kind=info["kind"],
                namespaced=info.get("namespaced", True),
                verbs=_VERBS,
                subresources=info.get("subresources", set()),
            )
        yield emulator


@pytest.fixture()
def kubeconfig(cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "emulator",
                "clusters": [{"name": "emulator", "cluster": {"server": str(cluster.url).rstrip("/")}}],
                "users": [{"name": "tester", "user": {"token": "test-token"}}],
                "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}],
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    return path


@pytest.fixture()
async def operator(kubeconfig: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KopfRunner]:
    """The real operator (``kopf run -m multiguess_operator``) against the emulator."""
    monkeypatch.setenv("MULTIGUESS_OPERATOR_IMAGE", "registry.test/multiguess-server:test")
    runner = KopfRunner(["run", "-A", "--standalone", "-m", "multiguess_operator"], timeout=60)
    runner.__enter__()
    try:
        yield runner
    finally:
        # Joining the operator's thread blocks; do it off the loop that serves the emulator.
        await asyncio.to_thread(runner.__exit__, None, None, None)


async def eventually(check: Callable[[], Any], timeout: float = 15.0, what: str = "") -> Any:
    """Poll ``check`` until it returns a truthy value (or stops raising AssertionError)."""
    deadline = asyncio.get_running_loop().time() + timeout
    last: BaseException | None = None
    while asyncio.get_running_loop().time() < deadline:
        try:
            value = check()
            if isinstance(value, Awaitable):
                value = await value
            if value:
                return value
        except AssertionError as e:
            last = e
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or check}") from last
