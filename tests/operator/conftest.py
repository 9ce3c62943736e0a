"""Fixtures: kmock's Kubernetes emulator (an in-memory API server over real HTTP) + kopf's KopfRunner.

Three things matter when reading these tests:

* The emulator is served by the *test's* event loop while the operator runs in KopfRunner's own
  thread, so tests must ``await`` (never ``time.sleep``) while they wait for the operator.
* The emulator stores objects as plain JSON and merges patches; it does not stamp metadata. The small
  subclass below adds what kopf and the operator read: namespace, uid, resourceVersion, generation,
  creationTimestamp. There is no garbage collector and no Deployment controller: tests play those.
* A failed JSON-patch ``test`` operation is answered with 422, as kube-apiserver does (kopf relies on it).
* Children (Deployments, Services, PodDisruptionBudgets, Secrets) get kube-apiserver's field
  ownership (tests/operator/fieldsets.py): server-side apply replaces what its manager owns instead
  of merging, and POST/PATCH record ``Update`` entries. Writes are checked the way the API server
  refuses them (a volume with two sources, a malformed quantity, a request above its limit), and
  ``Cluster.policies`` play admission policies a platform team installs.
* The official client reads KUBECONFIG at import time, so its default location is patched as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import itertools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import jsonpatch
import kmock
import kubernetes.config.kube_config
import pytest
import yaml
from kmock import action
from kmock._internal import parsing as kmock_parsing
from kopf.testing import KopfRunner
from kubernetes.utils import parse_quantity

from tests.operator import fieldsets

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "speculativedeployment.yaml"
SPECDEPLOYS = "multiguess.io/v1alpha1/speculativedeployments"
DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
PDBS = "policy/v1/poddisruptionbudgets"
PODS = "v1/pods"
EVENTS = "v1/events"
SECRETS = "v1/secrets"
NODES = "v1/nodes"
CLUSTER_PEERINGS = "kopf.dev/v1/clusterkopfpeerings"
PEERINGS = "kopf.dev/v1/kopfpeerings"
PEERING = "multiguess"
APPLY = "application/apply-patch+yaml"

_RESOURCES: dict[str, dict[str, Any]] = {
    SPECDEPLOYS: {"kind": "SpeculativeDeployment", "subresources": {"status", "scale"}},
    DEPLOYMENTS: {"kind": "Deployment", "subresources": {"status", "scale"}},
    SERVICES: {"kind": "Service"},
    PDBS: {"kind": "PodDisruptionBudget"},
    PODS: {"kind": "Pod"},
    EVENTS: {"kind": "Event"},
    SECRETS: {"kind": "Secret"},
    NODES: {"kind": "Node", "namespaced": False},
    CLUSTER_PEERINGS: {"kind": "ClusterKopfPeering", "namespaced": False},
    PEERINGS: {"kind": "KopfPeering"},
    "v1/namespaces": {"kind": "Namespace", "namespaced": False},
    "apiextensions.k8s.io/v1/customresourcedefinitions": {
        "kind": "CustomResourceDefinition",
        "namespaced": False,
    },
}
_VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}
_versions = itertools.count(1)
FIELD_MANAGED = {DEPLOYMENTS, SERVICES, PDBS, SECRETS}
# An admission policy: (resource, the object as it would be stored) -> None, or (HTTP status, message).
Policy = Callable[[str, Mapping[str, Any]], tuple[int, str] | None]


@attrs.define(kw_only=True)
class Cluster(kmock.KubernetesEmulator):
    """The emulator plus the metadata a real API server stamps on every write, field ownership for
    the children, and the refusals a real API server (and its admission policies) would answer."""

    policies: list[Policy] = attrs.field(factory=list)

    async def _handle(self, request: kmock.Request) -> Any:
        if (
            request.resource is not None
            and request.subresource is None
            and request.method in ("POST", "PATCH")
        ):
            resource = "/".join(
                p for p in (request.resource.group, request.resource.version, request.resource.plural) if p
            )
            if resource in FIELD_MANAGED:
                request = self._with_ownership(resource, request)
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

    def _with_ownership(self, resource: str, request: kmock.Request) -> kmock.Request:
        """The request rewritten to what kube-apiserver would store: an apply becomes the whole new
        object (as a create, or as a merge patch from the current one); writes record ownership."""
        current = self.get(resource, request.namespace or "", request.name or "") if request.name else None
        manager = (
            request.params.get("fieldManager") or request.headers.get("User-Agent", "unknown").split("/")[0]
        )
        content_type = request.headers.get("Content-Type", "")
        if request.method == "PATCH" and content_type.startswith(APPLY):
            if not request.params.get("fieldManager"):
                raise kmock.KubernetesError(
                    status=400, reason="BadRequest", message="fieldManager is required for apply"
                )
            try:
                after = fieldsets.apply(
                    current, request.data, manager, request.params.get("force") == "true", _now()
                )
            except fieldsets.ApplyConflict as e:
                raise kmock.KubernetesError(status=409, reason="Conflict", message=str(e)) from e
        elif isinstance(request.data, dict) and request.method == "POST":
            after = copy.deepcopy(request.data)
            fieldsets.record_update(None, after, manager, list(fieldsets.paths(request.data)), _now())
        elif isinstance(request.data, dict) and current is not None:
            after = _merged(current, request.data)
            if "managedFields" not in (request.data.get("metadata") or {}):
                fieldsets.record_update(current, after, manager, list(fieldsets.paths(request.data)), _now())
        else:
            return request  # a JSON patch (or a write to nothing): as kmock does it
        self._admit(resource, after)
        # The request object itself is rewritten: kmock matches its reactions by identity.
        if current is None:
            object.__setattr__(request, "action", action.CREATE)
            object.__setattr__(request, "data", after)
        else:
            object.__setattr__(request, "data", fieldsets.merge_patch(current, after))
        return request

    def _admit(self, resource: str, obj: Mapping[str, Any]) -> None:
        refusal = next(
            (r for r in (_invalid(resource, obj), *(p(resource, obj) for p in self.policies)) if r), None
        )
        if refusal is not None:
            status, message = refusal
            raise kmock.KubernetesError(
                status=status, reason="Invalid" if status == 422 else "Forbidden", message=message
            )

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


def _merged(current: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch applied (None removes a key)."""
    result = copy.deepcopy(dict(current))
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = _merged(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def _invalid(resource: str, obj: Mapping[str, Any]) -> tuple[int, str] | None:
    """What kube-apiserver's validation refuses in a Deployment (422), in its words."""
    if resource != DEPLOYMENTS:
        return None
    name = obj["metadata"]["name"]
    pod = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
    for i, volume in enumerate(pod.get("volumes") or []):
        if len(set(volume) - {"name"}) > 1:
            field = f"spec.template.spec.volumes[{i}]"
            return (
                422,
                f'Deployment.apps "{name}" is invalid: {field}: Forbidden: may not specify more than 1 volume type',
            )
    for i, container in enumerate(pod.get("containers") or []):
        resources = container.get("resources") or {}
        amounts: dict[str, dict[str, Any]] = {}
        for kind in ("limits", "requests"):
            for key, value in (resources.get(kind) or {}).items():
                field = f"spec.template.spec.containers[{i}].resources.{kind}[{key}]"
                try:
                    amounts.setdefault(kind, {})[key] = parse_quantity(value)
                except ValueError:
                    return (
                        422,
                        f'Deployment.apps "{name}" is invalid: {field}: Invalid value: "{value}": quantities must match the regular expression',
                    )
        for key, request in amounts.get("requests", {}).items():
            limit = amounts.get("limits", {}).get(key)
            if limit is not None and request > limit:
                field = f"spec.template.spec.containers[{i}].resources.requests"
                return (
                    422,
                    f'Deployment.apps "{name}" is invalid: {field}: Invalid value: "{request}": must be less than or equal to {key} limit of {limit}',
                )
    return None


def _path(resource: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    *group_version, plural = resource.split("/")
    root = "/api/v1" if group_version == ["v1"] else "/apis/" + "/".join(group_version)
    return "/".join(p for p in (root, "namespaces", namespace, plural, name, subresource) if p)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


_parse_path = kmock_parsing.parse_path


def parse_path_with_namespace_list(path: str) -> kmock_parsing.ParsedPath:
    """kmock reads ``/api/v1/namespaces`` (the namespace list kopf watches in namespaced mode) as
    a namespaced path without a namespace and fails; it is the ``namespaces`` resource."""
    if path.rstrip("/") == "/api/v1/namespaces":
        return kmock_parsing.ParsedPath(group="", version="v1", plural="namespaces")
    return _parse_path(path)


def register_resources(emulator: Cluster) -> None:
    """The kinds the operator reads and writes, served by the emulator's discovery and API."""
    for resource, info in _RESOURCES.items():
        emulator.resources[resource] = kmock.ResourceInfo(
            kind=info["kind"],
            namespaced=info.get("namespaced", True),
            verbs=_VERBS,
            subresources=info.get("subresources", set()),
        )


def kubeconfig_text(server: str) -> str:
    """A kubeconfig whose only context is the emulator at ``server``, with a bearer token."""
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": server.rstrip("/")}}],
            "users": [{"name": "tester", "user": {"token": "test-token"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}],
        }
    )


@pytest.fixture()
async def cluster(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    monkeypatch.setattr(kmock_parsing, "parse_path", parse_path_with_namespace_list)
    async with Cluster() as emulator, kmock.Server(emulator):
        register_resources(emulator)
        yield emulator


@pytest.fixture()
def kubeconfig(cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(kubeconfig_text(str(cluster.url)))
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    return path


@pytest.fixture()
async def operator(kubeconfig: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KopfRunner]:
    """The real operator (``kopf run -m multiguess_operator``) against the emulator."""
    monkeypatch.setenv("MULTIGUESS_OPERATOR_IMAGE", "registry.test/multiguess-server:test")
    async with running_operator(["-A", "--standalone"]) as runner:
        yield runner


@contextlib.asynccontextmanager
async def running_operator(args: list[str]) -> AsyncIterator[KopfRunner]:
    """``kopf run ARGS -m multiguess_operator`` in KopfRunner's thread, stopped on exit."""
    runner = KopfRunner(["run", *args, "-m", "multiguess_operator"], timeout=60)
    runner.__enter__()
    try:
        yield runner
    finally:
        # Joining the operator's thread blocks; do it off the loop that serves the emulator.
        await asyncio.to_thread(runner.__exit__, None, None, None)


async def create_namespace(cluster: Cluster, name: str) -> None:
    """A Namespace object: kopf watching a namespace list only follows namespaces that exist."""
    await cluster._json(
        "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    )


async def create_peering(cluster: Cluster, namespace: str | None = None) -> None:
    """The peering object the chart creates (kopf needs it to exist when peering is named)."""
    kind, path = (
        ("ClusterKopfPeering", "/apis/kopf.dev/v1/clusterkopfpeerings")
        if namespace is None
        else (
            "KopfPeering",
            f"/apis/kopf.dev/v1/namespaces/{namespace}/kopfpeerings",
        )
    )
    meta = {"name": PEERING} if namespace is None else {"name": PEERING, "namespace": namespace}
    await cluster._json("POST", path, {"apiVersion": "kopf.dev/v1", "kind": kind, "metadata": meta})


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
